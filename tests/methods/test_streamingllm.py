"""StreamingLLM keeps the sinks and the most recent tokens, and rolls while decoding."""

import torch

from common import kept_positions, random_layer
from kvcompress import get_method


def test_keeps_sinks_and_recent_window():
    layer, context, _, _, _ = random_layer(length=50)
    layer.compress(get_method("streamingllm", budget=12, sinks=4))
    assert kept_positions(layer) == [[[0, 1, 2, 3] + list(range(42, 50))] * 2]


def test_decoding_rolls_the_window_within_budget():
    layer, context, _, _, _ = random_layer(length=30)
    method = get_method("streamingllm", budget=10, sinks=2)
    layer.compress(method)
    for step in range(30, 45):
        layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[step]]))
        if method.acts_while_decoding:
            layer.decode_step(method)
        assert int(layer.head_lengths().max()) <= 10
    assert kept_positions(layer) == [[[0, 1] + list(range(37, 45))] * 2]


def test_without_rolling_every_decoded_token_stays():
    layer, context, _, _, _ = random_layer(length=30)
    method = get_method("streamingllm+static", budget=10, sinks=2)
    layer.compress(method)
    for step in range(30, 45):
        layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[step]]))
        if method.acts_while_decoding:
            layer.decode_step(method)
    assert kept_positions(layer) == [[[0, 1] + list(range(22, 45))] * 2]
