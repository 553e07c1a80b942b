"""The optional C extensions are built wherever the install found a C compiler."""
from __future__ import annotations

import shutil

import pytest

from transfer import memcopy
from worker.model.layers import decode_linear, paged_decode, pointwise, prefill_native


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the Python/torch paths run")
@pytest.mark.parametrize("module", [memcopy, paged_decode], ids=lambda m: m.__name__)
def test_native_loop_is_built(module) -> None:
    assert module.NATIVE, f"{module.__name__}'s C extension was not built; reinstall (pip install -e .)"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: torch's ops run")
@pytest.mark.parametrize("extension", [lambda: prefill_native._prefill_native, lambda: pointwise._pointwise,
                                       lambda: decode_linear._decode_linear],
                         ids=["_prefill_native", "_pointwise", "_decode_linear"])
def test_avx512_kernels_are_built(extension) -> None:
    # Built wherever a compiler is; they can run where the CPU has AVX-512 or AMX (their module's SUPPORTED).
    assert extension() is not None, "reinstall (pip install -e .) to build the AVX-512 kernels"
