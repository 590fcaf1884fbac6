"""Only what pyproject.toml cannot say: ship the checkout's ``models.toml`` inside the package.

The registry lives at the project root, where users edit it and the docs point; package data
must sit inside a package, so the build copies it to ``dflash_core/models.toml``. An installed
package reads that copy (``dflash_core.registry.default_registry_path``); a checkout has no copy
and reads the root file itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithRegistry(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "dflash_core" / "models.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "models.toml", target)


setup(cmdclass={"build_py": BuildPyWithRegistry})
