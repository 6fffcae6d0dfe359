"""The frontier study's runner (its protocol: studies/frontier_tiers.py, its verdicts:
studies/frontier_summary.py).

Runs already made by the long-schedule study with identical settings (full,
random-30, topk_entropy-30, sampled-30, same_budget-30, InfoBatch at R = 50)
are read from its committed records. Every finished run leaves a small record
in studies/results/frontier_runs/; rerunning the command continues the study:

  python -m studies.frontier --out=studies/out/frontier
  python -m studies.frontier --out=studies/out/frontier --tiers A2    # tier A' alone
  python -m studies.frontier --out=studies/out/frontier --tiers A2G   # then tier G
  python -m studies.frontier --out=studies/out/frontier --tiers H     # tier H
  python -m studies.frontier --out=studies/out/frontier --tiers N     # tier N
  python -m studies.frontier --tiers HN --dry-run   # the runs they would make, nothing trained
  python -m studies.frontier --tiers N --seeds=23,28 # only these seeds' runs (one worker's)

On a machine with cores and device memory to spare (a GPU box), studies/frontier_workers.sh
runs a tier's seeds in parallel processes, one `--seeds` group each.
"""

import argparse
import logging
import os
import time
import traceback

from cpjax.data import input_pipeline
from cpjax.runtime import preemption
from studies import grid, long_schedule
from studies.frontier_summary import (
  BUDGET_TABLE_PAGE,
  choose,
  write_budget_table,
  write_outputs,
)
from studies.frontier_tiers import (
  LONG_RECORDS,
  RECORDS,
  TIER_SEEDS,
  TIERS,
  Arm,
  a2_arms,
  base_config,
  g_arms,
  h_arms,
  later_arms,
  n_arms,
  parse_arms,
  parse_seeds,
  parse_tiers,
  run_overrides,
  search_arms,
)

# ---------------------------------------------------------------------------------------------
# The loop.


def _record(records: str, arm: Arm, seed: int) -> str:
  """The run's record: the long-schedule study's where that study made the same run."""
  if arm.long_name:
    path = long_schedule.record_path(LONG_RECORDS, arm.long_name, seed)
    if os.path.exists(path):
      return path
  return long_schedule.record_path(records, arm.name, seed)


def planned_runs(tier_arms: list[Arm]) -> list[tuple[Arm, int]]:
  """A tier's (arm, seed) runs in the order they train: seed by seed, each seed's arms in
  order, so that a tier cut short is paired."""
  return [(a, s) for s in sorted({s for a in tier_arms for s in a.seeds})
          for a in tier_arms if s in a.seeds]


def left_out(arm: Arm, seed: int, only: list[str], seeds: set[int]) -> str:
  """The option that leaves this run out ('--arms', '--seeds'), or '' when it is to run. A
  run left out still reads its finished record (tier A's decide the choice that the later
  tiers need); it trains nothing."""
  return ("--arms" if only and arm.name not in only
          else "--seeds" if seeds and seed not in seeds else "")


def plan_lines(tier: str, todo: list[tuple[Arm, int]], records: str, only: list[str],
               seeds: set[int] = frozenset()) -> list[str]:
  """--dry-run's listing: per run its arm, seed, the overrides it trains with, and whether its
  record exists (or --arms or --seeds leaves it out)."""
  lines = [f"tier {tier}: {len(todo)} runs"]
  for i, (arm, seed) in enumerate(todo):
    option = left_out(arm, seed, only, seeds)
    state = ("recorded" if os.path.exists(_record(records, arm, seed))
             else f"left out by {option}" if option else "to train")
    lines.append(f"  {i + 1}/{len(todo)} {arm.name} seed {seed} ({state}): "
                 + " ".join(f"{k}={v}" for k, v in run_overrides(arm, seed).items()))
  return lines


def _run(base, arm: Arm, seed: int, out: str, records: str, results: dict, failures: dict,
         label: str, summarise_only: bool, quiet: bool = False) -> None:
  workdir = os.path.join(out, arm.name, f"seed{seed}")
  record = _record(records, arm, seed)
  finished = os.path.exists(record) or os.path.exists(
      os.path.join(workdir, "report", "results.json"))
  if summarise_only and not finished:
    return
  if not quiet:
    print(f"[{time.strftime('%H:%M:%S')}] {label}: tier {arm.tier} {arm.name} seed {seed}"
          + (" (finished)" if finished else ""), flush=True)
  try:
    row = long_schedule.run_row(base, run_overrides(arm, seed), workdir, record)
    long_schedule._add(results, arm.name, seed, row)  # pylint: disable=protected-access
  except preemption.Preempted:
    raise  # A stop request stops the study; its checkpoint resumes the run on the rerun.
  except Exception as err:  # One failed run must not stop the study: it is reported.
    failures[f"{arm.name} seed {seed}"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(f"[{time.strftime('%H:%M:%S')}] FAILED {arm.name} seed {seed}: "
          f"{traceback.format_exc()}", flush=True)


def _tier_arms(tier: str, arms: list[Arm], results: dict, base) -> list[Arm] | None:
  """The arms that `tier` runs, or None while the choice it follows is not made: C-F follow
  tier A's, G the tier-A' (A2) one; H and N run their declared designs. Tier A' runs beside
  full data's seeds 0-2 (read from their records), so that its arms have their reference in
  the summary when it runs alone."""
  if tier == "H":
    return h_arms(base)
  if tier == "N":
    return n_arms(base)
  if tier in ("C", "D", "E", "F"):
    chosen = choose(arms, results)
    return None if chosen is None else [a for a in later_arms(chosen, base) if a.tier == tier]
  if tier == "G":
    chosen = choose(arms, results, "A2")
    return None if chosen is None else g_arms(chosen)
  full = [a for a in arms if a.name == "full"] if tier == "A2" else []
  return full + [a for a in arms if a.tier == tier]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="studies/out/frontier",
                      help="workdirs (checkpoints, reports), summary and figure")
  parser.add_argument("--records", default=RECORDS,
                      help=f"one small file per finished run (default {RECORDS})")
  parser.add_argument("--tiers", default="".join(TIERS),
                      help="tiers to run, in order (default ACFDBEA2GHN; A2 is tier A', "
                           "e.g. --tiers A2, then --tiers A2G for tier G; --tiers H, --tiers N)")
  parser.add_argument("--arms", default="",
                      help="comma-separated arm names: run only these (e.g. a cut-down tier "
                           "B: --tiers B --arms topk_anneal-55,topk_anneal-70); default all")
  parser.add_argument("--seeds", default="",
                      help="comma-separated seeds: train only these of the tiers' runs, the "
                           "others' records still read (e.g. one process per seed group, on "
                           "a machine with cores and device memory to spare); default all")
  parser.add_argument("--data-dir", default="",
                      help="tfds data dir for the prepared Fashion-MNIST (default "
                           "~/tensorflow_datasets); training is unchanged")
  parser.add_argument("--manual-dir", default="",
                      help="the folder of Fashion-MNIST's four IDX files, gzipped or not "
                           "(default Debian's "
                           "/usr/share/datasets/fashion-mnist); training is unchanged")
  parser.add_argument("--prepare-data", action="store_true",
                      help="prepare Fashion-MNIST in --data-dir from --manual-dir and stop: "
                           "once, before parallel processes would each prepare it at once")
  parser.add_argument("--summarise-only", action="store_true",
                      help="rewrite the summary from finished runs, train nothing")
  parser.add_argument("--dry-run", action="store_true",
                      help="list each tier's runs (arm, seed, overrides, recorded or to train) "
                           "and stop: nothing trained, nothing written")
  parser.add_argument("--budget-table", default="", metavar="SUMMARY_JSON",
                      help=f"rewrite {BUDGET_TABLE_PAGE}'s budget table from this summary.json "
                           "(e.g. studies/results/frontier.json) and stop; nothing trained")
  args = parser.parse_args()
  if args.budget_table:
    write_budget_table(args.budget_table)
    return
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
  base = grid.apply(base_config(), {"dataset.data_dir": args.data_dir,
                                     "dataset.manual_dir": args.manual_dir})
  if args.prepare_data:
    input_pipeline.open_or_prepare(base.dataset.name, base.dataset)
    return
  command = f"python -m studies.frontier --out={args.out}"
  if not args.dry_run:
    os.makedirs(args.out, exist_ok=True)
  arms = search_arms(base) + a2_arms()
  only = parse_arms(args.arms, base)
  tiers = parse_tiers(args.tiers)
  seeds = parse_seeds(args.seeds, {s for t in tiers for s in TIER_SEEDS[t]})
  results, failures = {}, {}
  for tier in tiers:
    tier_arms = _tier_arms(tier, arms, results, base)
    if tier_arms is None:
      print(f"[{time.strftime('%H:%M:%S')}] tier {tier} waits for tier "
            f"{'A' if tier in 'CDEF' else 'A2'}'s choice", flush=True)
      continue
    arms += [a for a in tier_arms if a not in arms]
    todo = planned_runs(tier_arms)
    if args.dry_run:
      print("\n".join(plan_lines(tier, todo, args.records, only, seeds)), flush=True)
    for i, (arm, seed) in enumerate(todo):
      skip = args.summarise_only or args.dry_run or bool(left_out(arm, seed, only, seeds))
      _run(base, arm, seed, args.out, args.records, results, failures,
           f"tier {tier} run {i + 1}/{len(todo)}", skip, quiet=args.dry_run)
      if not skip:
        write_outputs(args.out, arms, results, choose(arms, results), command, failures)
  if args.dry_run:
    return
  write_outputs(args.out, arms, results, choose(arms, results), command, failures)
  print(f"[{time.strftime('%H:%M:%S')}] done: {args.out}/summary.md", flush=True)


if __name__ == "__main__":
  main()
