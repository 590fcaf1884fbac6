"""The exactness tests as on an AVX2-only CPU (an AMD EPYC Zen 2/3), from an AVX-512 one."""

from __future__ import annotations

import pytest

from exactness_elsewhere import exactness_tests_pass_as


@pytest.mark.slow
def test_the_exactness_tests_pass_as_on_an_avx2_cpu(tmp_path):
    exactness_tests_pass_as("avx2", tmp_path)
