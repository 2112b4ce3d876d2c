"""Packed state against one buffer per leaf, by the number of steps a call.

    python benchmarks/bench_pack_steps.py [--quick] [--repeats N] [--block-seconds S]
        [--steps 1,2,4,8,16,32] [--jobs J] [--out PREFIX]

The report's Equinox step (a narrow ResNet50 with Adam, 484 state arrays: `models.py`) under
`autoflat.step` at each number of steps a call, its state packed (`pack=True`) and one buffer
per leaf (`pack=False`). A packed state costs few buffers a call, so little host time, but
inside a call of several steps its buffer is carried through the `num_steps` scan, and the
leaves that the forward pass reads are cut out of it and packed again in every step: device
time per step. One buffer per leaf costs host time once a call, shared by its steps. Where
the two cross depends on the backend; on a TPU it sets `pack="auto"`'s rule
(`_transport.host.TPU_UNPACKED_STEPS`).

Every method is checked against the others on the same batches before timing, then timed as
`harness.py` times them (blocks round-robin, the order rotating every repeat, each method
continuing from its own state). Reported: µs per step, median (min-max), and packed over one
buffer per leaf. Written to `--out`.md and `--out`.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness, models  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__.splitlines()[0], width=2, batch_size=8, image_size=16)
    ap.add_argument("--steps", default="1,2,4,8,16,32", help="steps a call, comma-separated")
    ap.add_argument("--jobs", type=int, default=2, help="first calls (compiles) at a time")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "pack_steps"), help="prefix"
    )
    args = ap.parse_args(argv)
    steps = [int(k) for k in args.steps.split(",")]
    repeats = args.repeats or (3 if args.quick else 7)
    block_s = args.block_seconds or (0.1 if args.quick else 0.5)
    machine, versions = harness.machine(), harness.versions()
    harness.log("\n".join(harness.environment_lines(machine, versions)))

    s = models.Setup(args.width, args.batch_size, args.image_size)
    methods = [
        harness.autoflat_method(f"autoflat_{k}{suffix}", models.update, s.fresh)
        for k in steps
        for suffix in ("_pack", "")
    ]
    figures = harness.check_and_time(
        "packed against one buffer per leaf", methods, s.args, s.checks, repeats, block_s,
        args.jobs,
    )  # fmt: skip
    rows = harness.method_rows(methods)
    report: dict[str, Any] = {
        "command": harness.command("benchmarks/bench_pack_steps.py", sys.argv[1:]),
        "machine": machine,
        "versions": versions,
        "config": {"repeats": repeats, "block_s": block_s, "steps": steps},
        "rows": rows,
        **figures,
    }
    harness.write_json(report, args.out + ".json")

    by_key = {r["key"]: r for r in rows}
    body = []
    for k in steps:
        packed, flat = by_key[f"autoflat_{k}_pack"], by_key[f"autoflat_{k}"]
        cells = [str(k)]
        for r in (packed, flat):
            t = r.get("us_per_step")
            cells.append(
                r["error"][:40]
                if t is None
                else f"{harness.fmt(t['median'])} ({harness.spread(t)})"
            )
        ratio = (
            packed["us_per_step"]["median"] / flat["us_per_step"]["median"]
            if "error" not in packed and "error" not in flat
            else None
        )
        cells.append("–" if ratio is None else f"{ratio:.2f}")
        body.append(cells)
    header = ["steps a call", "packed (`pack=True`)", "one buffer per leaf", "packed ÷ per leaf"]
    lines = [
        "# Packed state against one buffer per leaf, by steps a call",
        "",
        *harness.environment_lines(machine, versions, harness.load_average()),
        f"- **Config**: {repeats} repeats of ~{block_s} s blocks, round-robin; µs per step, "
        "median (min–max)",
        "",
        *harness.table(header, "rrrr", body),
        "",
        harness.agreement_line(figures["agreement"]),
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
