"""Evaluation: built-in tasks and task files, metrics, the eval runner and its reports."""
