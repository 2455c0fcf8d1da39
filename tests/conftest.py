import os
import shutil

import pytest
import torch

import nelssa.config as cfgmod


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the environment's config and leaves no override behind."""
    cfgmod.set_config(cfgmod.load_config())
    yield
    cfgmod.set_config(cfgmod.load_config())


@pytest.fixture
def use_cpp():
    """Switch the kernel path: use_cpp(True/False)."""
    def set_(on: bool) -> None:
        cfgmod.set_config(cfgmod.get_config().replace(use_cpp=on))
    return set_


@pytest.fixture(scope="session")
def model_dir():
    from nelssa.models import prepare_smollm2
    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def cut_model_dir():
    """SmolLM2's first 8 layers (nelssa.models.prepare_smollm2_cut), for the engine tests of the
    mechanism rather than of the model's answers."""
    from nelssa.models import prepare_smollm2_cut
    return str(prepare_smollm2_cut(8))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def lse_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute LSE difference: an LSE error d rescales the attention weights by exp(d), so it
    is absolute (a relative error is ill-conditioned where an LSE is near 0)."""
    return float((a.double() - b.double()).abs().max())


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# Every CPU engine the tests start (harness runs, servers, benchmarks: all enforce_eager) inherits this.
# What torch.compile is left in an eager vLLM CPU engine is its random sampler (compiled_random_sample),
# compiled at every engine start by the profile run's dummy sampling; inductor then probes its vector
# ISAs by building and loading test libraries, each load in a fresh Python that imports torch: 30 of an
# engine start's 40 s on a 2-vCPU Intel Xeon (2026-12-03; 9 s without), in every one of the suite's ~30
# engine processes, cached nowhere across them. Eager, that function is the same four ops (softmax,
# exponential noise, div, argmax; greedy requests do not reach it), so the tests run it so; a user's
# engine is left as vLLM makes it. Not on a GPU host (no CPU engines there).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
