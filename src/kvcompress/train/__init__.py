"""Training what methods learn: retention gates (``retention.py``)."""
