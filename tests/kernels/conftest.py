import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Empty, size 1, odd sizes around the vector width and the 64K chunk, many small.
SHAPES = [(0,), (1,), (7,), (3, 5), (17, 33), (65536,), (65537,), (2, 70001)] + [(13,)] * 40


def make_tensors(dtype, shapes=SHAPES, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]


@pytest.fixture
def big_shapes():
    """A few large tensors (1-4M elements) next to small ones."""
    return [(1024, 1024), (4 * 1024 * 1024 + 3,), (5,), (2048, 513)]
