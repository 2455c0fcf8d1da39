import os

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
