import sys
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from a second thread, and one thread keeps timings out of the way
# of anything else on a 2-core machine.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_random_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def packed_store_in_a_temporary_folder(tmp_path_factory):
    """Packed models written by the tests go to a folder of the session, not the user's cache (the
    kernel checks still come from the user's cache: compiling and checking is what takes long)."""
    from specdec.models import packed_store

    root = tmp_path_factory.mktemp("packed")
    original = packed_store.store_root
    packed_store.store_root = lambda: root
    yield root
    packed_store.store_root = original


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_pair(model_dir):
    """A float-friendly target with three drafts: itself, an independent model, a perturbed copy."""
    target = save_random_model(model_dir / "target", "llama", seed=0, init_scale=0.3)
    return {
        "target": target,
        "same": target,
        "independent": save_random_model(model_dir / "independent", "llama", seed=1, init_scale=0.3),
        "perturbed": save_random_model(model_dir / "perturbed", perturb_from=target, perturb_scale=0.03, seed=2),
    }


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory):
    """A 256-wide qwen2 model: wide enough that a matmul's blocking shows in float32's last bits."""
    from test_exact_blocks import WIDE

    return save_random_model(tmp_path_factory.mktemp("wide") / "qwen2", "qwen2", init_scale=0.05, **WIDE)
