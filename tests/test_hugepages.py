"""CPU tensors on 2 MiB pages (``hugepages.py``): zeros like ``torch.zeros``, advised for huge pages where the tensor takes
one; parameters moved there with their values and ties; the slot pool's large arrays there."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvcompress import hugepages
from kvcompress.store.slots import SlotPool

ADVISES = hugepages.advises()


def advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding the tensor's first byte is advised for huge pages (``hg`` in /proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 700), min_size=1, max_size=3), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int32]))
def test_zeros_are_torch_zeros_of_the_shape_and_dtype(shape, dtype):
    tensor = hugepages.zeros(*shape, dtype=dtype)
    assert tensor.shape == tuple(shape) and tensor.dtype == dtype and tensor.is_contiguous() and not tensor.any()
    tensor.fill_(3)  # writable, all of it
    assert (tensor == 3).all()
    if tensor.numel() * tensor.element_size() >= hugepages.HUGE_PAGE and ADVISES:
        assert tensor.data_ptr() % hugepages.HUGE_PAGE == 0


@pytest.mark.skipif(not ADVISES, reason="huge pages are advised on Linux only")
def test_a_large_tensor_is_advised_for_huge_pages_and_a_small_one_is_pytorchs():
    large, small = hugepages.zeros(3 << 20, dtype=torch.float32), hugepages.zeros(1000, dtype=torch.float32)
    assert advised(large) and not advised(small)


def test_zeros_off_the_cpu_are_torch_zeros_there():
    tensor = hugepages.zeros(3 << 20, dtype=torch.float32, device="meta")  # past 2 MiB: no mapping made off the CPU
    assert tensor.device.type == "meta" and tensor.shape == (3 << 20,)


def test_moving_parameters_keeps_their_values_and_ties():
    model = nn.Sequential(nn.Embedding(2048, 512), nn.Linear(512, 2048, bias=True), nn.LayerNorm(2048))
    model[1].weight = model[0].weight  # tied, as a causal LM's embedding and head: [2048, 512], 4 MiB
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    parameters = list(model.parameters())
    hugepages.move_parameters(model)
    assert list(model.parameters()) == parameters  # the same Parameter objects
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    assert model[1].weight is model[0].weight
    if ADVISES:
        assert model[0].weight.data_ptr() % hugepages.HUGE_PAGE == 0
        assert all(advised(p) for p in parameters)  # the small ones too: one mapping for all


@pytest.mark.skipif(not ADVISES, reason="huge pages are advised on Linux only")
@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([torch.float32, torch.bfloat16, torch.int8])), min_size=1, max_size=8))
def test_moved_parameters_lie_one_after_another_each_on_its_own_storage(sizes):
    """In the module's order, each at a cache line's start right after the one before, each over its own bytes; moved
    again, nothing moves."""
    module = nn.Module()
    for i, (numel, dtype) in enumerate(sizes):
        values = torch.randn(numel) * 50 if dtype.is_floating_point else torch.randint(-100, 100, (numel,))
        module.register_parameter(f"p{i}", nn.Parameter(values.to(dtype), requires_grad=False))
    before = [p.detach().clone() for p in module.parameters()]
    hugepages.move_parameters(module)
    moved = list(module.parameters())
    assert moved[0].data_ptr() % hugepages.HUGE_PAGE == 0
    end = moved[0].data_ptr()
    for p, value in zip(moved, before):
        assert torch.equal(p, value) and p.data_ptr() % hugepages.ALIGN == 0
        assert end <= p.data_ptr() < end + hugepages.ALIGN  # right after the one before, aligned
        storage = p.untyped_storage()
        assert storage.data_ptr() == p.data_ptr() and storage.nbytes() == p.numel() * p.element_size()
        end = p.data_ptr() + storage.nbytes()
    pointers = [p.data_ptr() for p in moved]
    hugepages.move_parameters(module)
    assert [p.data_ptr() for p in module.parameters()] == pointers


@pytest.mark.skipif(not ADVISES, reason="huge pages are advised on Linux only")
def test_moved_parameters_save_as_separate_tensors(tmp_path):
    """No two moved parameters share a storage, so safetensors (which refuses shared tensors) saves them as before."""
    from safetensors.torch import load_file, save_file

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False))
    hugepages.move_parameters(model)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[name], p) for name, p in model.state_dict().items())


@pytest.mark.skipif(not ADVISES, reason="huge pages are advised on Linux only")
def test_where_the_kernel_refuses_the_advice_zeros_are_torchs_and_no_parameter_moves(monkeypatch):
    import mmap
    import types

    class Refusing:  # a mapping whose kernel was built without transparent huge pages
        def __init__(self, *args, **kwargs):
            self.region, self.closed = mmap.mmap(*args, **kwargs), False

        def madvise(self, advice):
            raise OSError("EINVAL")

        def close(self):
            self.closed = True
            self.region.close()

    made = []
    fake = types.SimpleNamespace(**{name: getattr(mmap, name) for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_HUGEPAGE")},
                                 mmap=lambda *a, **k: made.append(Refusing(*a, **k)) or made[-1])
    monkeypatch.setattr(hugepages, "mmap", fake)
    tensor = hugepages.zeros(3 << 20, dtype=torch.float32)
    assert tensor.shape == (3 << 20,) and not tensor.any() and not advised(tensor)
    model = nn.Linear(512, 2048)
    pointers = [p.data_ptr() for p in model.parameters()]
    hugepages.move_parameters(model)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert len(made) == 2 and all(m.closed for m in made)


def test_the_slot_pools_large_arrays_lie_on_huge_pages_and_grow_there():
    pool = SlotPool(64, capacity=1 << 16, initial=1 << 13)  # keys and values of 8193 slots: 2 MiB each
    for array in pool.arrays.values():
        assert not array.any()
        if ADVISES:
            assert array.data_ptr() % hugepages.HUGE_PAGE == 0 and advised(array)
    slots = pool.allocate(10_000)  # past its first size: the arrays grow, the held entries kept
    keys, values = torch.randn(10_000, 64), torch.randn(10_000, 64)
    pool.write(slots, keys, values)
    got_keys, got_values = pool.gather(slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    if ADVISES:
        assert all(advised(array) for array in pool.arrays.values())
