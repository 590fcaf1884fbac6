"""The exactness tests as on an AVX-512 CPU without AMX (an AMD EPYC Zen 4), from an AMX Xeon."""

from __future__ import annotations

import pytest

from exactness_elsewhere import exactness_tests_pass_as


@pytest.mark.slow
def test_the_exactness_tests_pass_as_on_an_avx512_cpu_without_amx(tmp_path):
    exactness_tests_pass_as("avx512-no-amx", tmp_path)
