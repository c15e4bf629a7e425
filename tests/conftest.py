import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py

# Without a GPU, the CUDA runtime's Triton kernels run interpreted (tests/test_cuda_runtime.py).
# Set before anything imports Triton (transformers does), which reads it once.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads the real embedded model (select with -m slow)")
    config.addinivalue_line("markers", "ci: a slow test that CI runs anyway (-m 'not slow or ci')")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is ~50x faster than two on a busy 2-core machine. Modules of
    tiny-model tests use it for all their tests (`pytestmark`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
