"""What folding rotary and SiLU(gate) x up into C++ gained the int4 layers (``q4_layers``): a pass
of the int4 pair's target with the layers as they run, and with those two steps back in PyTorch
(rotary and the q/k/v split as ``FastTarget.rope`` and slices; SiLU x up then a cast, as before),
in one process, taking turns; what docs/BENCHMARKS-AMD.md cites.

    python scripts/q4_fusion_ab.py [--pair smollm2-135m-int4]

30 passes of 2 and of 16 rows after 150 cached positions, each undone; 8 rounds after a warm-up;
prints the median milliseconds a pass.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from dflash_core import q4_layers
from dflash_core.engine import Engine
from pass_times import pass_ms  # scripts/, the folder Python runs this script from


def eager_before(self, x, cos, sin):
    h, kv, d = self.split
    qkv = self.qkv.floats(x.contiguous(), self.ln1, self.target.eps).unflatten(-1, (h + 2 * kv, d))
    qk = self.target.rope(qkv[:, : h + kv], cos, sin)
    return qk[:, :h], qk[:, h:], qkv[:, h + kv :]


def eager_after(self, x, attention):
    x = self.o.floats(attention.contiguous(), add=x.contiguous())
    gate, up = self.gate_up.floats(x, self.ln2, self.eps).chunk(2, dim=-1)
    return self.down.rows((F.silu(gate) * up).to(torch.bfloat16), add=x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m-int4")
    opts = parser.parse_args()
    runner = Engine.from_registry(opts.pair).target.runner
    print(runner.kernel_note)
    fused = (q4_layers.Q4Before.__call__, q4_layers.Q4After.__call__)
    variants = {"rotary and SiLU x up in PyTorch": (eager_before, eager_after), "fused": fused}
    context = torch.arange(100, 250)
    for rows in (2, 16):
        block = torch.arange(300, 300 + rows)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(9):
            for name, (before, after) in (list(variants.items()) if round_ % 2 else list(variants.items())[::-1]):
                q4_layers.Q4Before.__call__, q4_layers.Q4After.__call__ = before, after
                ms = pass_ms(runner, context, block)
                if round_:
                    times[name].append(ms)
        q4_layers.Q4Before.__call__, q4_layers.Q4After.__call__ = fused
        print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(t):.2f} ms" for name, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
