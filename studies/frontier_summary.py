"""The frontier study's statistics and summary: its records judged by the rules that
studies/frontier_tiers.py declares (the choices, the TOSTs and one-sided tests, the two-level
bootstrap, the seconds), written as summary.json, summary.md and the frontier figure, and the
budget table of docs/studies.md.
"""

import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from cpjax.selection import subsets  # noqa: E402
from studies import equivalence, grid, long_schedule  # noqa: E402
from studies.frontier_tiers import (  # noqa: E402
  A2_POLICIES,
  CONFIRM_SEEDS,
  G_SEEDS,
  H_CHOICE,
  H_PASSES,
  H_SEEDS,
  LONG_RECORDS,
  N_DESIGN,
  N_SEEDS,
  NOISE,
  POLICIES,
  REPLICATE_SEEDS,
  SEARCH_SEEDS,
  Arm,
  a2_arms,
  base_config,
  n_arms,
  search_arms,
)

MARGIN, MIN_MEAN, ALPHA = equivalence.MARGIN, equivalence.MIN_MEAN, equivalence.ALPHA
tost, lossless = equivalence.tost, equivalence.lossless


# ---------------------------------------------------------------------------------------------
# Statistics.


def paired_differences(arm: dict, reference: dict, key: str = "accuracy") -> tuple[list, list]:
  """(seeds, arm - reference per seed) over the seeds both runs finished."""
  seeds = sorted(set(arm["seed_index"]) & set(reference["seed_index"]))
  return seeds, [arm[key][arm["seed_index"][s]] - reference[key][reference["seed_index"][s]]
                 for s in seeds]


def choose(arms: list[Arm], results: dict, tier: str = "A") -> Arm | None:
  """The pre-registered choice: among `tier`'s selecting arms (A; A2: tier A') with at most
  half of full data's passes and all search seeds finished, the highest mean validation
  accuracy (the first listed on a tie). None until every arm of the tier has finished."""
  full = results.get("full")
  candidates = [a for a in arms if a.tier == tier and a.policy != "full"]
  if full is None or any(len(results.get(a.name, {}).get("seed_index", {}))
                         < len(SEARCH_SEEDS) for a in candidates):
    return None
  full_passes = float(np.mean(full["passes"]))
  cheap = [a for a in candidates if np.mean(results[a.name]["passes"]) <= full_passes / 2]
  return max(cheap, key=lambda a: np.mean(results[a.name]["val_accuracy"]), default=None)


def summarise(arms: list[Arm], results: dict) -> dict:
  """Per arm: passes as a share of full data's, accuracies, the paired test against the full
  data run of the same regime and schedule on the same seeds."""
  references = {"C": "full@confirm", "D": "noisy_full@confirm", "E": "full_e30",
                "F": "full@replicate", "G": "full@confirm_g", "H": "full@confirm_h",
                "N": "noisy_full@confirm_n"}
  summary = {}
  for arm in arms:
    r = results.get(arm.name)
    if r is None:
      continue
    reference = results.get(references.get(arm.tier, "full"))
    row = {"policy": arm.policy, "tier": arm.tier, "budget": arm.budget,
           "seeds": sorted(r["seed_index"]), "planned_seeds": len(arm.seeds),
           "accuracy": float(np.mean(r["accuracy"])),
           "accuracy_sd": float(np.std(r["accuracy"], ddof=1)) if len(r["accuracy"]) > 1 else 0.0,
           "val_accuracy": float(np.mean(r["val_accuracy"])),
           "ece": float(np.mean(r["ece"])),
           "passes": float(np.mean(r["passes"]))}
    if reference is not None:
      row["passes_share"] = row["passes"] / float(np.mean(reference["passes"]))
      row.update(costs(r, reference))
      if reference is not r:
        seeds, d = paired_differences(r, reference)
        test = tost(d)
        row["vs_full"] = {**test, "seeds": seeds, "lossless": lossless(test)}
    summary[arm.name] = row
  return summary


SEARCH_TIERS = ("A", "A2", "B")  # The tiers on seeds 0-2 beside full data's seeds 0-2.


def frontier_answers(summary: dict) -> dict:
  """For each policy: the largest saving (1 - passes share) at which it is lossless on the
  search seeds (all of 0-2: an arm short of them does not count yet), or None."""
  out = {}
  for name, row in summary.items():
    if row["tier"] not in SEARCH_TIERS or "vs_full" not in row:
      continue
    out.setdefault(row["policy"], None)
    if len(row["seeds"]) < row["planned_seeds"]:
      continue
    best = out.get(row["policy"])
    saving = 1 - row["passes_share"]
    if row["vs_full"]["lossless"] and (best is None or saving > best["saving"]):
      out[row["policy"]] = {"arm": name, "saving": saving}
    out.setdefault(row["policy"], None)
  return out


def smallest_not_worse(summary: dict) -> dict:
  """For each policy, over the search tiers (A, A', B; seeds 0-2): the arm with the smallest share
  of full data's passes that is *not shown worse* than full data (the 90 % t interval of the
  paired difference reaches 0 or above), or None; and the arms shown equivalent by the TOST.
  An arm short of seeds 0-2 is listed under `incomplete` (name, seeds run) and counts for
  neither, so that a policy's answer never rests on a part of its seeds."""
  out = {}
  for name, row in summary.items():
    if row["tier"] not in SEARCH_TIERS or "vs_full" not in row:
      continue
    entry = out.setdefault(row["policy"], {"not_worse": None, "equivalent": [], "incomplete": []})
    if len(row["seeds"]) < row["planned_seeds"]:
      entry["incomplete"].append((name, len(row["seeds"])))
      continue
    vs = row["vs_full"]
    if np.isfinite(vs["high"]) and vs["high"] >= 0:
      best = entry["not_worse"]
      if best is None or row["passes_share"] < best["passes_share"]:
        entry["not_worse"] = {"arm": name, "passes_share": row["passes_share"]}
    if vs["equivalent"]:
      entry["equivalent"].append(name)
  return out


def _verdict_arms(chosen: Arm) -> tuple:
  """The chosen arm's later tiers: (verdict key, arm name, the seeds that complete it)."""
  return (("untouched", f"{chosen.name}@confirm", CONFIRM_SEEDS),
          ("replicate", f"{chosen.name}@replicate", REPLICATE_SEEDS),
          ("noisy", f"noisy_{chosen.name}@confirm", CONFIRM_SEEDS),
          ("epochs_30", f"{chosen.name}_e30", SEARCH_SEEDS))


def pooled_test(results: dict, pairs: list[tuple[str, str]]) -> dict | None:
  """The TOST on the per-seed differences of several (arm, reference) pairs pooled; seeds are
  distinct across the pairs (tiers C and F: 3-7 and 8-12)."""
  seeds, d = [], []
  for arm, reference in pairs:
    if arm in results and reference in results:
      s, diff = paired_differences(results[arm], results[reference])
      seeds += s
      d += diff
  if not seeds:
    return None
  return {**tost(d), "seeds": seeds}


def test_image_intervals(results: dict, arm: str, reference: str, seeds) -> dict:
  """A paired bootstrap over the test images (the same resampled images for both runs of a
  seed, and for every seed): the 90 % interval of the seed-mean difference in test accuracy
  over `seeds`, and of each seed's own difference. The test set's sampling uncertainty,
  beside the seed interval (which measures initialisation and data order)."""
  a, r = results[arm], results[reference]
  if "correct" not in a or "correct" not in r or not len(seeds):
    return {}  # No paired seed yet (e.g. one worker's arm before its full-data run).
  interval = long_schedule.test_interval
  per_seed = {int(s): [float(a["accuracy"][a["seed_index"][s]]
                             - r["accuracy"][r["seed_index"][s]]),
                       *interval(a, r, [s], "accuracy")] for s in seeds}
  return {"pooled": list(interval(a, r, list(seeds), "accuracy")), "per_seed": per_seed,
          "seeds_and_images": seed_and_image_interval(a, r, list(seeds))}


# The two-level bootstrap's resamples: at 1,000 its interval's ends moved by about 0.01 points
# between generator seeds, at 4,000 by about half that.
TWO_LEVEL_RESAMPLES = 4000


def seed_and_image_interval(arm: dict, reference: dict, seeds: list, rng_seed: int = 0
                            ) -> list[float]:
  """A two-level paired bootstrap of the seed-mean difference in test accuracy: each of
  TWO_LEVEL_RESAMPLES resamples draws the test images with replacement (the same images
  for both runs of a seed and for every seed) and then the seeds with replacement, so that its
  90 % percentile interval holds both the seeds' spread and the test set's own sampling (the
  seed interval holds the first, `test_image_intervals`' pooled interval the second)."""
  d = np.array([np.asarray(arm["correct"][arm["seed_index"][s]], np.float64)
                - np.asarray(reference["correct"][reference["seed_index"][s]], np.float64)
                for s in seeds])  # [seeds, images]
  rng = np.random.default_rng(rng_seed)
  means = np.empty(TWO_LEVEL_RESAMPLES)
  for b in range(len(means)):
    per_seed = d[:, rng.integers(0, d.shape[1], d.shape[1])].mean(1)
    means[b] = per_seed[rng.integers(0, len(seeds), len(seeds))].mean()
  tail = (1 - long_schedule.CONFIDENCE) / 2
  return [float(q) for q in np.quantile(means, [tail, 1 - tail])]


def verdicts(summary: dict, chosen: Arm | None, results: dict | None = None) -> dict:
  """The chosen arm's later tiers against full data of the same regime and seeds: C
  (untouched seeds 3-7: the lossless-at-half verdict), F (its replication on seeds 8-12),
  C and F pooled (seeds 3-12), D (per-seed label noise), E (30 epochs). Each with its seeds,
  saving in passes, paired TOST and whether it is complete; C's, F's and the pooled
  `met`: complete, lossless and at least 50 % fewer passes. With `results` (per-image
  correctness), each clean tier also gets the test images' paired bootstrap interval."""
  if chosen is None:
    return {}
  out = {}
  for key, name, seeds in _verdict_arms(chosen):
    row = summary.get(name)
    if row is None or "vs_full" not in row:
      continue
    vs = row["vs_full"]
    out[key] = {"arm": name, "seeds": vs["seeds"], "complete": tuple(vs["seeds"]) == seeds,
                "saving": 1 - row["passes_share"],
                "saving_with_evaluation": 1 - row.get("passes_share_with_evaluation", math.nan),
                **vs}
  test = pooled_test(results or {}, [(f"{chosen.name}@confirm", "full@confirm"),
                                     (f"{chosen.name}@replicate", "full@replicate")])
  if test is not None and "untouched" in out and "replicate" in out:
    out["pooled"] = {"arm": f"{chosen.name}@confirm + @replicate", **test,
                     "complete": tuple(test["seeds"]) == CONFIRM_SEEDS + REPLICATE_SEEDS,
                     "saving": out["untouched"]["saving"], "lossless": lossless(test),
                     "saving_with_evaluation": out["untouched"]["saving_with_evaluation"]}
  for key in ("untouched", "replicate", "pooled"):
    if key in out:
      v = out[key]
      v["met"] = bool(v["complete"] and v["lossless"] and v["saving"] >= 0.5)
  if results:
    tiers = {"untouched": ("@confirm",), "replicate": ("@replicate",),
             "pooled": ("@confirm", "@replicate")}
    for key, suffixes in tiers.items():
      if key in out:
        arm = _merged(results, [f"{chosen.name}{x}" for x in suffixes])
        reference = _merged(results, [f"full{x}" for x in suffixes])
        out[key]["test_images"] = test_image_intervals({"arm": arm, "full": reference}, "arm",
                                                       "full", out[key]["seeds"])
  return out


def _merged(results: dict, names: list[str]) -> dict:
  """The per-seed results of several arms with distinct seeds as one (tiers C and F)."""
  out = {"seed_index": {}}
  for name in names:
    r = results.get(name, {"seed_index": {}})
    for seed, i in r["seed_index"].items():
      out["seed_index"][seed] = len(out["seed_index"])
      for key in ("accuracy", "correct"):
        if key in r:
          out.setdefault(key, []).append(r[key][i])
  return out


def _outcome(v: dict, short: bool = False) -> str:
  """What a verdict's test shows: lossless or not and, where the 90 % interval excludes 0,
  on which side of full data the arm is (`short`: without the reasons, for the figure); for
  tier N's superiority test, better or not."""
  if "superior" in v:
    return ("better" if v["superior"] else "below full data" if v["high"] < 0
            else "not shown better")
  if v["low"] > 0:  # Better than full data is not equivalent to it: say which way it fails.
    return "above full data" + ("" if short else ": its 90 % interval excludes 0 (better, so "
                                                 "not equivalent)")
  why = ("lossless" if v["lossless"] else "not lossless" if short or not v["equivalent"]
         else "not lossless: mean below -0.1")
  if v["high"] < 0:
    why += ", below full data" if short else "; below full data: its 90 % interval excludes 0"
  return why


def _saving_text(v: dict) -> str:
  """'52 % fewer passes', and with evaluation's passes counted where the records tell them."""
  text = f"{100 * v['saving']:.0f} % fewer passes"
  with_evaluation = v.get("saving_with_evaluation", math.nan)
  if np.isfinite(with_evaluation):
    text += f" ({100 * with_evaluation:.1f} % fewer with evaluation's passes counted)"
  return text


def _images_text(images: dict) -> str:
  """The test images' intervals of a verdict: of the mean with the seeds fixed, with the seeds
  resampled too (`seed_and_image_interval`), and of each seed's difference."""
  low, high = images["pooled"]
  both = images.get("seeds_and_images")
  per_seed = "; ".join(f"seed {s}: {_pts(d)} [{_pts(lo)}, {_pts(hi)}]"
                       for s, (d, lo, hi) in images["per_seed"].items())
  return (f". Over test images (paired bootstrap, 90 %): mean [{_pts(low)}, {_pts(high)}]"
          + (f"; seeds and test images resampled together (two-level bootstrap, 90 %): "
             f"[{_pts(both[0])}, {_pts(both[1])}]" if both else "") + f"; {per_seed}")


def _verdict_line(label: str, v: dict) -> str:
  seeds = ",".join(map(str, v["seeds"]))
  status = "" if v["complete"] else " (incomplete: more seeds to run)"
  why = _outcome(v)
  line = (f"- {label}: `{v['arm']}`, {_saving_text(v)}, seeds {seeds}: "
          f"{_pts_interval(v)} points vs full data, "
          f"{equivalence.describe(v)}; {why}{status}")
  if v.get("test_images"):
    line += _images_text(v["test_images"])
  if v.get("earlier_reference"):
    e = v["earlier_reference"]
    line += (f". Its full-data reference here, {100 * v['reference_accuracy']:.2f} %, is "
             f"{100 * (e['accuracy'] - v['reference_accuracy']):.2f} points below the "
             f"long-schedule study's noisy full-data runs ({100 * e['accuracy']:.2f} %, seeds "
             f"{','.join(map(str, e['seeds']))}, one noise draw for every seed)")
  return line


def verdict_lines(found: dict) -> list[str]:
  """The markdown section answering: lossless at >= 50 % fewer passes on untouched seeds?
  Tier C's verdict first, as it was; then its replication (tier F) alone and pooled."""
  lines = ["", "## Lossless at half the passes or fewer, on untouched seeds?", ""]
  if "untouched" not in found:
    return lines + ["Not answered yet: the confirmation runs (tier C) have not finished."]
  u = found["untouched"]
  answer = ("met" if u["met"] else "not decided yet" if not u["complete"] else "missed")
  lines.append(f"**Tier C, seeds 3-7: {answer}.**")
  if "replicate" in found:
    r = found["replicate"]
    again = ("replicated" if r["met"] else "replication not finished" if not r["complete"]
             else "not replicated")
    lines.append(f"Replication on seeds 8-12 (tier F, declared before its runs): **{again}**.")
  labels = {"untouched": "tier C, untouched seeds 3-7, clean labels (the test)",
            "replicate": "tier F, untouched seeds 8-12 (the replication)",
            "pooled": "tiers C and F pooled, seeds 3-12",
            "noisy": "20 % label noise, one noise draw per seed (exploratory: the tier asked "
                     "whether the policy is equivalent to full data; a side of full data read "
                     "from its runs was not declared before them, and only a declared tier can "
                     "confirm it; tier N does. Its full-data runs drew their noise from the "
                     "random stream of epoch 5's order, as the code then did "
                     "(`splits.LABEL_NOISE_STREAM` now keeps them apart), so each trained "
                     "epoch 5 on all the flipped labels first, back to back; the policy's "
                     "runs, on a subset in epoch 5, did not)",
            "epochs_30": "30-epoch schedule (search seeds), vs full data on 30 epochs"}
  return lines + [_verdict_line(labels[k], found[k]) for k in labels if k in found]


def seconds_ratios(results: dict, arm: str, reference: str, seeds) -> dict:
  """Per seed, the arm's seconds over full data's of the same seed, with both runs' machines:
  `wall` (the training process's start to its end; a run resumed after an interruption counts
  its last part only) and `loop` (the loop's scoring + selection + training seconds,
  checkpointed, so a resumed run counts them all). Their geometric means over the seeds whose
  two runs name the same machine (as declared); beside them, `steady_*`: the same over those
  pairs whose two wall clocks are whole (`long_schedule.whole_runs`) and both runs at an even
  pace (EVEN_PACE), each pair flagged `whole` and `even`, as the Time section's rules are."""
  a, r = results[arm], results[reference]
  whole_a, whole_r = long_schedule.whole_runs(a), long_schedule.whole_runs(r)
  per_seed = {}
  for seed in seeds:
    i, j = a["seed_index"][seed], r["seed_index"][seed]
    machines = [run["machine"][k] if "machine" in run else "unknown"
                for run, k in ((a, i), (r, j))]
    per_seed[int(seed)] = {"wall": a["wall_seconds"][i] / r["wall_seconds"][j],
                           "loop": a["compute_seconds"][i] / r["compute_seconds"][j],
                           "machine": machines[0], "full_machine": machines[1],
                           "same_machine": machines[0] == machines[1] != "unknown",
                           "whole": i in whole_a and j in whole_r,
                           "even": "steady_seconds" in a and "steady_seconds" in r
                                   and _even(a, i) and _even(r, j)}
  same = [v for v in per_seed.values() if v["same_machine"]]
  whole = [v for v in same if v["whole"]]
  steady = [v for v in whole if v["even"]]
  out = {"per_seed": per_seed, "same_machine_seeds": len(same),
         "whole_seeds": sorted(s for s, v in per_seed.items() if v in whole),
         "steady_seeds": sorted(s for s, v in per_seed.items() if v in steady)}
  for prefix, pairs in (("", same), ("whole_", whole), ("steady_", steady)):
    for key in ("wall", "loop") if pairs else ():
      out[f"{prefix}{key}_geomean"] = float(np.exp(np.mean(np.log([v[key] for v in pairs]))))
  return out


def _new_seed_verdict(summary: dict, name: str, reference: str, seeds: tuple, met,
                      results: dict | None) -> dict:
  """An arm against its full-data reference on declared new seeds: its seeds, saving in
  passes, paired TOST, `lossless` and `met` (`met(verdict)`); with `results`, the test
  images' paired bootstrap and the seconds ratios. {} before its runs."""
  row = summary.get(name)
  if row is None or "vs_full" not in row:
    return {}
  vs = row["vs_full"]
  out = {"arm": name, "seeds": vs["seeds"], "complete": tuple(vs["seeds"]) == seeds,
         "saving": 1 - row["passes_share"], **vs}
  out["met"] = bool(met(out))
  if results:
    out["test_images"] = test_image_intervals(results, name, reference, vs["seeds"])
    out["seconds"] = seconds_ratios(results, name, reference, vs["seeds"])
  return out


def g_verdict(summary: dict, chosen: Arm | None, results: dict | None) -> dict:
  """Tier G: the tier-A' choice against full data on seeds 13-22 (`_new_seed_verdict`), `met`
  when complete, lossless and at least 50 % fewer passes. {} before its runs."""
  name = f"{chosen.name}@confirm_g" if chosen else ""
  return _new_seed_verdict(summary, name, "full@confirm_g", G_SEEDS,
                           lambda v: v["complete"] and v["lossless"] and v["saving"] >= 0.5,
                           results)


def second_search(summary: dict, arms: list[Arm], results: dict) -> dict:
  """The tier-A' choice and tier G's verdict, for the summary; {} while no tier-A' arm has a
  result, so that the summary of the earlier tiers stays as it was."""
  if not any(row["tier"] == "A2" for row in summary.values()):
    return {}
  chosen = choose(arms, results, "A2")
  return {"chosen_a2": chosen.name if chosen else None,
          "verdict_g": g_verdict(summary, chosen, results)}


def _seconds_line(seconds: dict) -> str:
  def flags(v: dict) -> str:
    marks = [m for m, ok in (("resumed", v["whole"]), ("uneven", v["even"])) if not ok]
    return f" ({', '.join(marks)})" if marks else ""
  per_seed = "; ".join(f"seed {s}: {v['wall']:.2f} ({v['loop']:.2f})" + flags(v)
                       + ("" if v["same_machine"] else
                          f" [{v['machine']} vs {v['full_machine']}]")
                       for s, v in seconds["per_seed"].items())
  machines = sorted({v["machine"] for v in seconds["per_seed"].values() if v["same_machine"]})
  mean = (f"geometric mean {seconds['wall_geomean']:.2f} ({seconds['loop_geomean']:.2f}) over "
          f"the {seconds['same_machine_seeds']} pairs run on one kind of machine "
          f"({'; '.join(machines)})" if seconds["same_machine_seeds"]
          else "no pair ran on one kind of machine")
  resumed = [s for s, v in seconds["per_seed"].items()
             if v["same_machine"] and not v["whole"]]
  if resumed and seconds["whole_seeds"]:
    mean += (f", seed{'s' * (len(resumed) > 1)} {','.join(map(str, resumed))}'s with a "
             f"resumed run's wall clock (its last sitting's); "
             f"{seconds['whole_wall_geomean']:.2f} ({seconds['whole_loop_geomean']:.2f}) over "
             f"the {len(seconds['whole_seeds'])} of them with whole wall clocks")
  steady = seconds["steady_seeds"]
  if steady:
    mean += (f"; {seconds['steady_wall_geomean']:.2f} ({seconds['steady_loop_geomean']:.2f}) "
             f"over the {len(steady)} of them with whole wall clocks at an even pace (seeds "
             f"{','.join(map(str, steady))}; the Time section's rules)")
  elif seconds["same_machine_seeds"]:
    mean += "; none of them with whole wall clocks at an even pace"
  return (f"- Seconds, the arm's over full data's, wall clock (loop seconds): {mean}. "
          f"Per seed (resumed: a wall clock of a last sitting; uneven: slowed by other work): "
          f"{per_seed}")


def second_lines(summary: dict, second: dict) -> list[str]:
  """The markdown sections of tiers A' and G; none before their runs."""
  if not second:
    return []
  lines = ["", "## Tier A': importance sampling against top-k at half the passes (seeds 0-2)",
           "", "Declared before its runs: importance sampling at two mixes (its loss weights "
           "the inverse inclusion probabilities, self-normalised to mean 1 over an epoch and "
           "clipped at 10), top-k with the 2-epoch "
           "finish at 50 % of the passes and InfoBatch at r = 0.95 without its loss weight, "
           "each paired with full data on seeds 0-2; the choice is tier A's rule applied to "
           "these arms.", ""]
  for name, row in summary.items():
    if row["tier"] == "A2" and "vs_full" in row:
      vs = row["vs_full"]
      lines.append(f"- `{name}`: {100 * row['passes_share']:.1f} % of the passes, validation "
                   f"{100 * row['val_accuracy']:.2f} %, test {_pts_interval(vs)} points vs full "
                   f"data, {equivalence.describe(vs)} (seeds {','.join(map(str, row['seeds']))})")
  chosen = second["chosen_a2"]
  lines += ["", f"Chosen: `{chosen}` (highest mean validation accuracy among the arms of "
            "tier A' at no more than half of full data's passes)." if chosen else
            "Not chosen yet: tier A' has not finished.",
            "", "## Tier G: the tier-A' choice on 10 new seeds (13-22)", ""]
  g = second["verdict_g"]
  if not g:
    return lines + ["Not answered yet: tier G has not run."]
  answer = "met" if g["met"] else "not decided yet" if not g["complete"] else "missed"
  lines += [f"**Lossless at half the passes or fewer: {answer}.**",
            _verdict_line("tier G, seeds 13-22", g)]
  if g.get("seconds"):
    lines.append(_seconds_line(g["seconds"]))
  return lines


# ---------------------------------------------------------------------------------------------
# Tiers H and N, declared before any of their runs.


def h_candidates(summary: dict) -> list[dict]:
  """Tier H's candidates: the search tiers' (A, A', B) arms with all of seeds 0-2 beside full
  data's and at H_PASSES[0] to H_PASSES[1] of full data's passes, each with its share, paired
  mean difference, TOST p and whether its mean is at least MIN_MEAN (`kept`), in the
  summary's order."""
  out = []
  for name, row in summary.items():
    vs = row.get("vs_full")
    if (row["tier"] in SEARCH_TIERS and vs and vs["seeds"] == list(SEARCH_SEEDS)
        and H_PASSES[0] <= row["passes_share"] <= H_PASSES[1]):
      out.append({"arm": name, "passes_share": row["passes_share"], "mean": vs["mean"],
                  "low": vs["low"], "high": vs["high"], "p": vs["p"],
                  "kept": bool(vs["mean"] >= MIN_MEAN)})
  return out


def choose_h(summary: dict) -> str | None:
  """Tier H's rule, declared before its runs: among `h_candidates` with a mean paired
  difference of at least MIN_MEAN (-0.1 points), the smallest TOST p; on a tie the smaller
  share of passes (the larger saving), then the first name in sorted order. None without one."""
  kept = [(c["p"], c["passes_share"], c["arm"]) for c in h_candidates(summary)
          if c["kept"] and np.isfinite(c["p"])]
  return min(kept)[2] if kept else None


def h_verdict(summary: dict, results: dict | None) -> dict:
  """Tier H: H_CHOICE against full data on seeds 23-32 (`_new_seed_verdict`), `met` when all
  10 seeds ran and it is lossless (at whatever saving it has). {} before its runs."""
  return _new_seed_verdict(summary, f"{H_CHOICE}@confirm_h", "full@confirm_h", H_SEEDS,
                           lambda v: v["complete"] and v["lossless"], results)


def n_verdict(summary: dict, results: dict | None) -> dict:
  """Tier N: N_DESIGN against full data on the same noisy labels, seeds 23-32: the one-sided
  superiority test (`equivalence.superiority`) on the paired differences, `better` when all 10
  seeds ran and its 90 % t interval lies above 0; the test images' paired bootstrap and the
  seconds ratios beside it. {} before its runs."""
  name, reference = f"noisy_{N_DESIGN}@confirm_n", "noisy_full@confirm_n"
  row = summary.get(name)
  if row is None or "vs_full" not in row or not results:
    return {}
  seeds, d = paired_differences(results[name], results[reference])
  out = {"arm": name, "seeds": seeds, "complete": tuple(seeds) == N_SEEDS,
         "saving": 1 - row["passes_share"], **equivalence.superiority(d)}
  out["better"] = bool(out["complete"] and out["superior"])
  out["test_images"] = test_image_intervals(results, name, reference, seeds)
  out["seconds"] = seconds_ratios(results, name, reference, seeds)
  return out


def declared_tiers(summary: dict, results: dict | None) -> dict:
  """Tiers H and N for the summary: H's declared pick, the rule applied to the summary's
  search rows (None without them), its candidates and verdict; N's arm and verdict."""
  return {"tier_h": {"declared_choice": H_CHOICE, "rule_choice": choose_h(summary),
                     "candidates": h_candidates(summary),
                     "verdict": h_verdict(summary, results)},
          "tier_n": {"arm": f"noisy_{N_DESIGN}@confirm_n", "verdict": n_verdict(summary, results)}}


def _state(v: dict, done: str, seeds: tuple) -> str:
  """'not run yet', 'not decided yet (k of n seeds)' or `done`."""
  if not v:
    return "not run yet"
  return done if v["complete"] else f"not decided yet ({len(v['seeds'])} of {len(seeds)} seeds)"


def _superiority_line(label: str, v: dict) -> str:
  """Tier N's verdict line: its interval, the one-sided test, which side of full data."""
  seeds = ",".join(map(str, v["seeds"]))
  why = ("better: its 90 % interval lies above 0" if v["superior"] else
         "below full data: its 90 % interval lies below 0" if v["high"] < 0 else
         "not shown better: its 90 % interval reaches 0")
  status = "" if v["complete"] else " (incomplete: more seeds to run)"
  p_value = f"one-sided p {v['p']:.3f}" if np.isfinite(v["p"]) else "untested (1 seed)"
  line = (f"- {label}: `{v['arm']}`, {_saving_text(v)}, seeds {seeds}: {_pts_interval(v)} "
          f"points vs full data on the same noisy labels, {p_value}; {why}{status}")
  if v.get("test_images"):
    line += _images_text(v["test_images"])
  return line


def _said(label: str, v: dict, seeds: tuple) -> str:
  """'`arm` on seeds 3-7 (tier C): -0.07 [-0.15, +0.00], lossless', with its seeds so far
  while incomplete."""
  so_far = "" if v["complete"] else f", {len(v['seeds'])} of {len(seeds)} seeds so far"
  return (f"`{v['arm']}` on seeds {seeds[0]}-{seeds[-1]} ({label}{so_far}): {_pts_interval(v)}, "
          + _outcome(v, short=True))


def headline_lines(summary: dict, found: dict, second: dict, declared: dict) -> list[str]:
  """The summary's headline: the current answer of each declared question. Lossless at half
  the passes: shown when the latest test of a design (tier C's pooled with its replication F,
  or tier G) is met; not shown when all of them are complete and none is met. Then tier H's
  and tier N's verdicts, or that they have not run."""
  lines = ["", "## The answer so far, across the declared tiers", ""]
  tests = [(key, label, seeds) for key, label, seeds in
           (("untouched", "tier C", CONFIRM_SEEDS),
            ("replicate", "tier F, its replication", REPLICATE_SEEDS),
            ("pooled", "tiers C and F", CONFIRM_SEEDS + REPLICATE_SEEDS)) if key in found]
  said = [_said(label, found[key], seeds) for key, label, seeds in tests]
  current = [found["pooled"] if "pooled" in found else found[tests[0][0]]] if tests else []
  g = (second or {}).get("verdict_g")
  if g:
    said.append(_said("tier G", g, G_SEEDS))
    current.append(g)
  word = ("not answered yet" if not current else "shown" if any(v["met"] for v in current)
          else "not shown" if all(v["complete"] for v in current) else "not decided yet")
  lines.append(f"- Lossless at half the passes or fewer (tiers C, F and G): **{word}**"
               + (". " + "; ".join(said) if said else ""))
  h, searched = declared["tier_h"]["verdict"], summary.get(H_CHOICE, {}).get("vs_full")
  pick = f"`{H_CHOICE}`" + (
      f", {100 * summary[H_CHOICE]['passes_share']:.1f} % of the passes, chosen on seeds 0-2 "
      f"where it was {_pts_interval(searched)} (TOST p {searched['p']:.3f})" if searched else "")
  done = ("missed" if not h or not h["met"] else
          f"lossless at {100 * h['saving']:.0f} % fewer passes")
  lines.append(f"- The largest lossless saving (tier H, {pick}): "
               f"**{_state(h, done, H_SEEDS)}**"
               + (f". {_said('tier H', h, H_SEEDS)}" if h else ""))
  n = declared["tier_n"]["verdict"]
  done = "better" if n and n["better"] else "not shown better"
  text = (f"- Selection under 20 % label noise (tier N, `{N_DESIGN}`): "
          f"**{_state(n, done, N_SEEDS)}**")
  if n:
    text += (f". `{n['arm']}` on seeds 23-32: {_pts_interval(n)} vs full data on the same "
             f"noisy labels, one-sided p {n['p']:.3f}")
  if "noisy" in found:
    text += (f"; tier D's {_pts_interval(found['noisy'])} on seeds 3-7 was exploratory, against "
             "a full-data reference that trained the flipped labels first in epoch 5 (tier D "
             "below)")
  return lines + [text]


def declared_lines(declared: dict) -> list[str]:
  """The markdown sections of tiers H and N: the rule and its candidates, then each verdict
  or that it has not run."""
  h, n = declared["tier_h"], declared["tier_n"]
  lines = ["", "## Tier H: the largest lossless saving, on 10 new seeds (23-32)", "",
           "Declared before its runs: among the search tiers' arms (A, A', B) with all of seeds "
           f"0-2 at {100 * H_PASSES[0]:.0f} to {100 * H_PASSES[1]:.0f} % of full data's passes "
           f"whose mean paired difference from full data is at least {100 * MIN_MEAN:+.1f} "
           "points, the smallest TOST p (ties: the smaller share of passes, then the name); "
           "the pick and full data then run on seeds 23-32. Lossless: the TOST at "
           f"±{100 * MARGIN:.1f} points passes (p < {ALPHA}) and the mean is at least "
           f"{100 * MIN_MEAN:+.1f} points, on all 10 seeds.", ""]
  for c in h["candidates"]:
    lines.append(f"- `{c['arm']}`: {100 * c['passes_share']:.1f} % of the passes, "
                 f"{_pts_interval(c)} points vs full data (TOST p {c['p']:.3f})"
                 + ("" if c["kept"] else "; mean below -0.1, not a candidate"))
  rule = h["rule_choice"]
  lines += ["", f"Declared pick: `{h['declared_choice']}`; the rule on this summary's records: "
            + (f"`{rule}`." if rule else "no search record here.")]
  v = h["verdict"]
  done = "missed" if not v or not v["met"] else f"met, {100 * v['saving']:.0f} % fewer passes"
  lines += ["", f"**Lossless on seeds 23-32: {_state(v, done, H_SEEDS)}.**"]
  if v:
    lines.append(_verdict_line("tier H, seeds 23-32", v))
    if v.get("seconds"):
      lines.append(_seconds_line(v["seconds"]))
  lines += ["", "## Tier N: selection under 20 % label noise, on 10 new seeds (23-32)", "",
            f"Declared before its runs: `{N_DESIGN}` (tier D's design) and full data, "
            f"{100 * NOISE:.0f} % of the training labels flipped uniformly to another class, "
            "each seed its own noise draw (the seed); better: on all 10 seeds the 90 % t "
            "interval of the mean paired difference lies above 0 (a one-sided t-test at "
            f"{ALPHA}).", ""]
  v = n["verdict"]
  done = "better" if v and v["better"] else "not shown better"
  lines.append(f"**Better than full data under label noise: {_state(v, done, N_SEEDS)}.**")
  if v:
    lines.append(_superiority_line("tier N, seeds 23-32", v))
    if v.get("seconds"):
      lines.append(_seconds_line(v["seconds"]))
  return lines


# ---------------------------------------------------------------------------------------------
# Costs beside the passes: evaluation's passes, the kept share, wall-clock.

# The validation images each evaluation passes beside the test images: the base config's
# dataset.val_size (a test checks it); a record holds only its test images' correctness.
VAL_IMAGES = 6000
# A run at an even pace: its training + scoring + selection seconds within 5 % of its steady
# seconds (long_schedule.steady_seconds: its epochs at their lower-quartile speed per step),
# i.e. no part of it much slowed by other work on the machine.
EVEN_PACE = 1.05
# What a run's record holds of its time (long_schedule._run_row, grid.run_cell).
TIME_KEYS = ("machine", "wall_seconds", "compute_seconds", "steady_seconds", "training_seconds",
             "scoring_seconds", "selection_seconds")


def evaluation_passes(r: dict) -> float | None:
  """Mean forward passes of an arm's evaluations: each evaluated epoch (its curve's, the last
  one's being the report's) passes the validation and the test images once. None without
  curves."""
  if "curve_epoch" not in r or "correct" not in r:
    return None
  return float(np.mean([len(e) * (VAL_IMAGES + len(c))
                        for e, c in zip(r["curve_epoch"], r["correct"])]))


def costs(r: dict, reference: dict) -> dict:
  """An arm's costs beside its training and scoring passes, from what its records hold: its
  evaluation's passes and its share of full data's passes with them counted; its seconds
  (`run_times`) and its time over full data's, paired per seed (`time_pairs`)."""
  out = {}
  evaluated = evaluation_passes(r), evaluation_passes(reference)
  if None not in evaluated:
    out["evaluation_passes"] = evaluated[0]
    out["passes_share_with_evaluation"] = float(
        (np.mean(r["passes"]) + evaluated[0]) / (np.mean(reference["passes"]) + evaluated[1]))
  if all(key in run for key in TIME_KEYS for run in (r, reference)):
    pairs = {} if reference is r else time_pairs(r, reference)
    out["time"] = {**run_times(r), "pairs": pairs, **mean_ratios(pairs)}
  return out


def _even(r: dict, i: int) -> bool:
  return r["compute_seconds"][i] <= EVEN_PACE * r["steady_seconds"][i]


def run_times(r: dict) -> dict:
  """The machines an arm's runs trained on, and mean seconds over its runs with a whole wall
  clock (`long_schedule.whole_runs`): wall clock, training, scoring + selection, and the rest
  of the wall clock (evaluation, compiling, data loading and the report)."""
  keep = long_schedule.whole_runs(r)
  mean = {key: float(np.mean([r[key][i] for i in keep])) if keep else math.nan
          for key in ("wall_seconds", "training_seconds", "scoring_seconds",
                      "selection_seconds", "compute_seconds")}
  return {"machines": sorted(set(r["machine"])),
          "whole_seeds": sorted(s for s, i in r["seed_index"].items() if i in keep),
          "wall": mean["wall_seconds"], "training": mean["training_seconds"],
          "scoring": mean["scoring_seconds"] + mean["selection_seconds"],
          "rest": mean["wall_seconds"] - mean["compute_seconds"]}


def time_pairs(r: dict, reference: dict) -> dict:
  """Per seed both ran, where both trained on the same machine (None where not: processors
  differ in speed): the arm's wall clock over full data's (None where either wall clock is a
  last sitting's, `long_schedule.whole_runs`), its training + scoring + selection seconds over
  full data's, and whether both ran at an even pace (EVEN_PACE)."""
  out = {}
  for seed in sorted(set(r["seed_index"]) & set(reference["seed_index"])):
    i, j = r["seed_index"][seed], reference["seed_index"][seed]
    if r["machine"][i] != reference["machine"][j]:
      out[seed] = None
      continue
    whole = i in long_schedule.whole_runs(r) and j in long_schedule.whole_runs(reference)
    out[seed] = {"machine": r["machine"][i],
                 "wall": r["wall_seconds"][i] / reference["wall_seconds"][j] if whole else None,
                 "compute": r["compute_seconds"][i] / reference["compute_seconds"][j],
                 "even": _even(r, i) and _even(reference, j)}
  return out


def mean_ratios(pairs: dict) -> dict:
  """Means over `time_pairs`: the wall-clock ratio over the same-machine pairs with whole wall
  clocks and over those of them at an even pace, and the ratio of training + scoring +
  selection seconds over the same-machine pairs at an even pace (each with its seeds)."""
  same = {s: p for s, p in pairs.items() if p is not None}
  wall = {s: p["wall"] for s, p in same.items() if p["wall"] is not None}
  even = {s: v for s, v in wall.items() if same[s]["even"]}
  def mean(values):
    return float(np.mean(list(values))) if values else math.nan
  return {"wall_ratio": mean(wall.values()), "wall_seeds": sorted(wall),
          "even_wall_ratio": mean(even.values()), "even_seeds": sorted(even),
          "compute_ratio": mean([p["compute"] for p in same.values() if p["even"]]),
          "compute_seeds": sorted(s for s, p in same.items() if p["even"])}


def kept_schedule(arm: Arm, base) -> dict:
  """What an arm trains on, from its config: its selected epochs (0-indexed, first and last),
  the kept fraction in the first and in the last of them (InfoBatch's follows the losses:
  None) and the epochs on all data after them. {} for an arm that selects nothing."""
  config = grid.apply(base, arm.overrides)
  s = config.selection
  if s.method == "full":
    return {}
  if s.method == "infobatch":
    after = config.num_epochs - subsets.anneal_start(config.num_epochs, s.anneal_fraction)
    kept = None
  else:
    after = s.final_full_epochs
    kept = [s.fraction, s.fraction if s.fraction_end < 0 else s.fraction_end]
  return {"epochs": [s.warmup_epochs, config.num_epochs - after - 1], "kept": kept,
          "full_after": after}


def mean_kept(schedule: dict, passes: float, full_passes: float) -> float:
  """The mean kept share over the selected epochs that a run's passes imply: (passes - its
  all-data epochs' passes) / (selected epochs x one all-data epoch's passes, full data's over
  its epochs). Within a batch's rounding per epoch; a scoring pass would count as training."""
  first, last = schedule["epochs"]
  epochs, selected = last + 1 + schedule["full_after"], last - first + 1
  per_epoch = full_passes / epochs
  return float((passes - per_epoch * (epochs - selected)) / (selected * per_epoch))


def add_kept(summary: dict, arms: list[Arm], base) -> None:
  """Each summarised arm's `kept_schedule`, in its summary row; an arm whose kept share follows
  the losses (InfoBatch) with the mean its passes imply (`mean_kept`)."""
  for arm in arms:
    row = summary.get(arm.name)
    if row is None:
      continue
    row["kept"] = kept = kept_schedule(arm, base)
    if kept and kept["kept"] is None and "passes_share" in row:
      kept["mean_from_passes"] = mean_kept(kept, row["passes"],
                                           row["passes"] / row["passes_share"])


def earlier_noisy_full(records: str = LONG_RECORDS) -> dict | None:
  """The long-schedule study's noisy full-data runs (one noise draw for every seed), beside
  tier D's reference: their seeds and mean test accuracy; None without their records."""
  paths = {s: long_schedule.record_path(records, "noisy_full", s) for s in SEARCH_SEEDS}
  found = {s: long_schedule.load_record(p)["accuracy"] for s, p in paths.items()
           if os.path.exists(p)}
  if not found:
    return None
  return {"seeds": sorted(found), "accuracy": float(np.mean(list(found.values())))}


# ---------------------------------------------------------------------------------------------
# Outputs.


def _pts(value: float) -> str:
  return "—" if value is None or not np.isfinite(value) else f"{100 * value:+.2f}"

def _pts_interval(v: dict) -> str:
  """A difference `v` (mean, low, high as fractions) in points: '-0.07 [-0.15, +0.00]'."""
  return f"{_pts(v['mean'])} [{_pts(v['low'])}, {_pts(v['high'])}]"


def _lossless_cell(row: dict) -> str:
  """The table's verdict: none before all of an arm's seeds have run (on 2 seeds the t
  interval is too wide, or of no width when both differences agree)."""
  vs = row.get("vs_full")
  if not vs:
    return "—"
  if len(row["seeds"]) < row["planned_seeds"]:
    return f"not yet ({len(row['seeds'])} of {row['planned_seeds']} seeds)"
  return "yes" if vs["lossless"] else "no"


def _evaluation_sentence(summary: dict) -> str:
  """What 'passes with evaluation' adds, with full data's evaluation passes where known."""
  full = summary.get("full", {}).get("evaluation_passes")
  per_run = (f" ({full:,.0f} in a 20-epoch run; a same-budget run, cut short, evaluates "
             "fewer times)") if full else ""
  return (" Passes with evaluation: the same with each evaluation's forward passes of the "
          f"{VAL_IMAGES:,} validation and the test images counted{per_run}; the rule's "
          "'half the passes' counts training and scoring alone. Kept per selected epoch: from "
          "the arm's config (InfoBatch's follows the losses: the mean its passes imply); "
          "epochs 0-indexed, epoch 0 on all data.")


def _kept_cell(row: dict) -> str:
  """'38.5 % in epochs 1-17, then 2 on all data', 'all data' (`kept_schedule`), or '—'."""
  k = row.get("kept")
  if k is None:
    return "—"
  if not k:
    return "all data, fewer steps" if row["policy"] == "same_budget" else "all data"
  if k["kept"] is None:
    share = f"≈ {100 * k.get('mean_from_passes', math.nan):.1f} % (mean)"
  elif k["kept"][0] == k["kept"][1]:
    share = f"{100 * k['kept'][0]:.1f} %"
  else:
    share = f"{100 * k['kept'][0]:.1f} → {100 * k['kept'][1]:.1f} %"
  then = f", then {k['full_after']} on all data" if k["full_after"] else ""
  return f"{share} in epochs {k['epochs'][0]}-{k['epochs'][1]}{then}"


def markdown(summary: dict, chosen: Arm | None, command: str, failures: dict,
             results: dict | None = None, second: dict | None = None,
             found: dict | None = None, declared: dict | None = None) -> str:
  """The summary's markdown; `second`: tiers A' and G (`second_search`); `found`: the
  verdicts (else computed from the summary); `declared`: tiers H and N (`declared_tiers`,
  else computed from the summary)."""
  found = found if found is not None else verdicts(summary, chosen, results)
  declared = declared if declared is not None else declared_tiers(summary, results)
  lines = ["# Accuracy-compute frontier (Fashion-MNIST, long schedule)", "",
           f"Command: `{command}`. Test accuracy in per cent; differences in points, paired "
           "per seed against full data of the same regime and schedule; [90 % t interval]; "
           f"TOST: two one-sided t-tests at a ±{100 * MARGIN:.1f}-point margin (p < {ALPHA}: "
           f"equivalent); lossless = equivalent and mean >= {100 * MIN_MEAN:+.1f} points. "
           "Passes: example passes (forward 1, forward + backward 3, scoring included) as a "
           "share of full data's." + _evaluation_sentence(summary),
           *headline_lines(summary, found, second or {}, declared), "", "## Every arm", "",
           "| arm | tier | seeds | passes | passes with evaluation | kept per selected epoch "
           "| test acc | val acc | vs full | TOST p | lossless |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, row in summary.items():
    vs = row.get("vs_full")
    cells = [name, row["tier"], ",".join(map(str, row["seeds"])),
             f"{100 * row.get('passes_share', math.nan):.1f} %",
             f"{100 * row.get('passes_share_with_evaluation', math.nan):.1f} %",
             _kept_cell(row),
             f"{100 * row['accuracy']:.2f} ± {100 * row['accuracy_sd']:.2f}",
             f"{100 * row['val_accuracy']:.2f}",
             f"{_pts(vs['mean'])} [{_pts(vs['low'])}, {_pts(vs['high'])}]" if vs else "—",
             f"{vs['p']:.3f}" if vs and np.isfinite(vs["p"]) else "—",
             _lossless_cell(row)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "## Largest lossless saving per policy (search seeds 0-2)", ""]
  for policy, best in frontier_answers(summary).items():
    lines.append(f"- {policy}: " + (f"{100 * best['saving']:.0f} % fewer passes ({best['arm']})"
                                    if best else "not lossless at any budget run"))
  lines += ["", "## Smallest share of passes not shown worse than full data (search seeds 0-2)",
            "", "Not shown worse: the 90 % t interval of the paired difference reaches 0. That "
            "is not equivalence; the arms shown equivalent (TOST) are named after it.", ""]
  for policy, entry in smallest_not_worse(summary).items():
    best = entry["not_worse"]
    where = (f"{100 * best['passes_share']:.1f} % of the passes ({best['arm']})" if best
             else "worse than full data at every budget run on all of seeds 0-2")
    same = ", ".join(entry["equivalent"]) or "none"
    running = "".join(f"; not counted yet: {name} ({n} of {len(SEARCH_SEEDS)} seeds)"
                      for name, n in entry["incomplete"])
    lines.append(f"- {policy}: {where}; shown equivalent: {same}{running}")
  lines += ["", "## The chosen policy", "",
            (f"`{chosen.name}` (highest mean validation accuracy among tier A's arms at no more "
             "than half of full data's passes)." if chosen else
             "Not chosen yet: tier A has not finished.")]
  lines += verdict_lines(found)
  lines += second_lines(summary, second or {})
  lines += declared_lines(declared)
  lines += time_lines(summary)
  if results:
    lines += ["", "## Records", "", grid.code_versions_line(results)]
  if failures:
    lines += ["", "## Failed runs", ""] + [f"- {k}: {v}" for k, v in failures.items()]
  return "\n".join(lines) + "\n"


def _seconds(value: float) -> str:
  return "—" if not np.isfinite(value) else f"{value:.0f}"


def _mean_with_seeds(value: float, seeds: list) -> str:
  """'0.52 (seeds 3,4,5)', or '—' over no seed."""
  if not seeds:
    return "—"
  return f"{value:.2f} (seed{'s' * (len(seeds) > 1)} {','.join(map(str, seeds))})"


def _ratio_cells(t: dict) -> list[str]:
  """Per seed: the wall-clock ratio, or why there is none; the means (`mean_ratios`)."""
  per_seed = []
  for seed, p in t["pairs"].items():
    why = ("other machine" if p is None else "resumed" if p["wall"] is None
           else f"{p['wall']:.2f}" + ("" if p["even"] else " (uneven)"))
    per_seed.append(f"{seed}: {why}")
  if not t["pairs"]:
    return ["—"] * 4
  return ["; ".join(per_seed),
          f"{t['wall_ratio']:.2f}" if t["wall_seeds"] else "—",
          _mean_with_seeds(t["even_wall_ratio"], t["even_seeds"]),
          _mean_with_seeds(t["compute_ratio"], t["compute_seeds"])]


def time_lines(summary: dict) -> list[str]:
  """The wall-clock section: each arm's seconds (`run_times`) and its time over full data's
  (`time_pairs`, `mean_ratios`), the machines named below the table."""
  rows = {name: row["time"] for name, row in summary.items() if "time" in row}
  if not rows:
    return []
  machines = list(dict.fromkeys(m for t in rows.values() for m in t["machines"]))
  label = {m: f"M{i + 1}" for i, m in enumerate(machines)}
  lines = ["", "## Time", "",
           "Seconds as each run's record holds them, means over its runs with a whole wall "
           "clock. Wall: the run's `train.train_and_evaluate`, start to report "
           "(`studies.grid.run_cell`); "
           "training and scoring + selection: the loop's phase seconds, summed over sittings; "
           "rest: wall minus those (evaluation, compiling, data loading, the report). A "
           "resumed run's wall clock is its last sitting's alone: a run whose wall clock is "
           "below its phase seconds counts as resumed and is left out of the wall columns (a "
           "resume whose last sitting was the longer part is not told apart). Ratios: the "
           "arm's over full data's of the same tier and seed, only where both trained on the "
           "same machine (as recorded); uneven: either run's phase seconds more than "
           f"{100 * (EVEN_PACE - 1):.0f} % above its steady seconds (its epochs at their "
           "lower-quartile speed), i.e. slowed by other work; phase seconds / full's: the mean "
           "over the pairs at an even pace. Some sittings shared the machine with other work, "
           "so only ratios of one seed on one machine compare. A machine string names a kind "
           "of machine, not a sitting, and this kind's speed varied between sittings: full "
           "data's seeds 0-2 (tiers A and B's reference) are the long-schedule study's runs, "
           "from other sittings than this study's own tier-A and tier-B arms, so those ratios "
           "compare sittings as much as policies; tiers C to F ran each seed's arm beside its "
           "full-data run (seed by seed).", "",
           "| arm | machines | whole runs | wall s | training s | scoring + selection s | rest s "
           "| wall / full's, per seed | mean | at an even pace | phase seconds / full's, even "
           "pace |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, t in rows.items():
    cells = [name, ", ".join(label[m] for m in t["machines"]),
             ",".join(map(str, t["whole_seeds"])) or "—",
             *(_seconds(t[k]) for k in ("wall", "training", "scoring", "rest")),
             *_ratio_cells(t)]
    lines.append("| " + " | ".join(cells) + " |")
  return lines + ["", "Machines: " + "; ".join(f"{label[m]}: {m}" for m in machines) + "."]


def _mean_interval(values) -> tuple[float, float]:
  """(mean, half-width of the 90 % t interval of the mean) of per-seed values; 0 for one."""
  v = np.asarray(values, np.float64)
  if len(v) < 2:
    return float(v.mean()), 0.0
  return float(v.mean()), float(stats.t.ppf(1 - ALPHA, len(v) - 1)
                                * v.std(ddof=1) / math.sqrt(len(v)))


# How far below full data each panel reaches, in points. An arm far below (InfoBatch at
# r = 0.95, about -10) would otherwise squash the arms near 0 that the figure is for: it is
# marked at the panel's floor with its numbers instead.
FIGURE_FLOOR = 3.0


def plot_frontier(arms: list[Arm], results: dict, summary: dict, path: str,
                  found: dict | None = None) -> None:
  """Writes `draw_frontier`'s figure to `path`."""
  fig = draw_frontier(arms, results, summary, found)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def draw_frontier(arms: list[Arm], results: dict, summary: dict,
                  found: dict | None = None) -> plt.Figure:
  """Left: test accuracy against the share of full data's passes, one line per policy (mean
  over seeds 0-2, bars: the 90 % t interval of that mean), full data as a band (its 90 %
  interval). Right: each arm's paired difference from full data on the same seeds with its
  90 % t interval (the TOST's interval) and the ±0.2-point equivalence margin; an arm whose
  bar reaches 0 is not shown worse, one whose bar lies inside the margin is equivalent. Both
  panels stop `FIGURE_FLOOR` points below full data; an arm below that is a marker at the
  floor with its numbers. The chosen arm's later tiers (`verdicts`) as text under the panels,
  since they are paired on other seeds or schedules."""
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 7.5))
  full = results.get("full")
  acc_floor = None
  if full is not None:
    mean, half = _mean_interval(100 * np.asarray(full["accuracy"]))
    acc_floor = mean - FIGURE_FLOOR
    ax.axhspan(mean - half, mean + half, color="grey", alpha=0.3,
               label=f"full data (90 % interval, {len(full['accuracy'])} seeds)")
  below = []  # (axis, x, floor, colour, text) of the arms under a panel's floor.
  for i, policy in enumerate(POLICIES + A2_POLICIES):
    # An arm has a share of passes only beside full data's records (not with `--tiers B`
    # alone before tier A has run): without one it has no place on either axis.
    names = sorted((a.name for a in arms if a.policy == policy and a.tier in SEARCH_TIERS
                    and "passes_share" in summary.get(a.name, {})),
                   key=lambda n: summary[n]["passes_share"])
    if not names:
      continue
    colour, style = long_schedule.STYLES[i]
    x = np.array([100 * summary[n]["passes_share"] for n in names])
    acc = [_mean_interval(100 * np.asarray(results[n]["accuracy"])) for n in names]
    ax.errorbar(x, [m for m, _ in acc], yerr=[h for _, h in acc], fmt=style, color=colour,
                marker="o", capsize=3, label=policy)
    for xi, n, (m, h) in zip(x, names, acc):
      if acc_floor is not None and m < acc_floor:
        below.append((ax, xi, acc_floor, colour, f"{n}: {m:.1f} [{m - h:.1f}, {m + h:.1f}] %"))
    vs = [summary[n].get("vs_full") for n in names]
    keep = []
    for j, v in enumerate(vs):
      if not v or not np.isfinite(v["low"]):
        continue
      if 100 * v["mean"] >= -FIGURE_FLOOR:
        keep.append(j)
      else:
        below.append((bx, x[j], -FIGURE_FLOOR, colour, f"{names[j]}: {_pts_interval(v)}"))
    if keep:
      mid = np.array([100 * vs[j]["mean"] for j in keep])
      bx.errorbar(x[keep] + (i - len(POLICIES) / 2) * 0.25, mid,
                  yerr=[mid - [100 * vs[j]["low"] for j in keep],
                        [100 * vs[j]["high"] for j in keep] - mid],
                  fmt="o", color=colour, capsize=3, label=policy)
    for xi, n in zip(x, names):  # A point short of its seeds is preliminary: say so.
      if len(results[n]["accuracy"]) < len(SEARCH_SEEDS):
        ax.annotate(f"{len(results[n]['accuracy'])} seed", (xi, acc[names.index(n)][0]),
                    xytext=(4, -10), textcoords="offset points", fontsize=7, color=colour)
  for axis in (ax, bx):
    axis.axvline(50, color="black", linestyle=":", linewidth=1)
    axis.set_xlim(20, 102)
    axis.set_xlabel("example passes, % of full data's (scoring included)")
    axis.grid(alpha=0.3)
  bx.axhline(0, color="black", linewidth=1)
  bx.axhspan(-100 * MARGIN, 100 * MARGIN, color="green", alpha=0.08,
             label=f"equivalence margin ±{100 * MARGIN:.1f}")
  if acc_floor is not None:
    ax.set_ylim(bottom=acc_floor - 0.3)
  bx.set_ylim(bottom=-FIGURE_FLOOR - 0.3)
  for axis, xi, floor, colour, text in below:
    axis.plot([xi], [floor - 0.15], marker="v", color=colour, markersize=8)
    axis.annotate(f"{text} (below)", (xi, floor - 0.15), xytext=(8, -3),
                  textcoords="offset points", fontsize=7, color=colour)
  ax.set_ylabel("test accuracy % (mean of seeds 0-2, 90 % t interval)")
  bx.set_ylabel("vs full data, points (paired per seed, 90 % t interval)")
  ax.set_title("Fashion-MNIST, small_cnn, 20 epochs: accuracy vs training compute")
  bx.set_title("Paired difference from full data (same seeds)")
  for axis, size, where in ((ax, 8, "lower right"), (bx, 7, "lower right")):
    if axis.get_legend_handles_labels()[0]:  # Nothing to name before any comparable run.
      axis.legend(fontsize=size, loc=where)
  fig.tight_layout()
  if found:
    text = "\n".join(f"{v['arm']} (seeds {','.join(map(str, v['seeds']))}): "
                     f"{_pts_interval(v)} vs full, "
                     + _outcome(v, short=True)
                     for v in found.values())
    fig.subplots_adjust(bottom=0.2)
    fig.text(ax.get_position().x0, 0.01, text, fontsize=8, va="bottom",
             bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "grey"})
  return fig


def note_earlier_reference(found: dict, summary: dict, earlier: dict | None) -> dict:
  """Tier D's verdict with its full-data reference's mean accuracy beside the long-schedule
  study's noisy full-data runs (`earlier_noisy_full`)."""
  if earlier and "noisy" in found and "noisy_full@confirm" in summary:
    found["noisy"].update(reference_accuracy=summary["noisy_full@confirm"]["accuracy"],
                          earlier_reference=earlier)
  return found


def write_outputs(out: str, arms: list[Arm], results: dict, chosen, command: str,
                  failures: dict) -> None:
  summary = summarise(arms, results)
  add_kept(summary, arms, base_config())
  found = note_earlier_reference(verdicts(summary, chosen, results), summary,
                                 earlier_noisy_full())
  second = second_search(summary, arms, results)  # Tiers A' and G; {} before their runs.
  declared = declared_tiers(summary, results)  # Tiers H and N.
  slim = {name: {k: v for k, v in r.items() if k not in ("correct", "confidence")}
          for name, r in results.items()}
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"summary": summary, "frontier": frontier_answers(summary),
               "not_worse": smallest_not_worse(summary),
               "chosen": chosen.name if chosen else None,
               "verdicts": found, "margin": MARGIN, **second, **declared,
               "runs": slim, "failures": failures}, f, indent=1,
              default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(markdown(summary, chosen, command, failures, results, second, found, declared))
  later = {key: v for key, v in (("g", second.get("verdict_g")),
                                 ("h", declared["tier_h"]["verdict"]),
                                 ("n", declared["tier_n"]["verdict"])) if v}
  plot_frontier(arms, results, summary, os.path.join(out, "frontier.png"), {**found, **later})


# ---------------------------------------------------------------------------------------------
# docs/studies.md's budget table, from a summary.json (studies/results/frontier.json).

BUDGET_TABLE_PAGE = "docs/studies.md"
TABLE_START = ("<!-- The budget table: written from studies/results/frontier.json by python -m "
               "studies.frontier --budget-table=studies/results/frontier.json; do not edit by "
               "hand. -->")
TABLE_END = "<!-- End of the budget table. -->"


def _bracket(pair) -> str:
  return f"[{_pts(pair[0])}, {_pts(pair[1])}]"


def _passes_cell(row: dict) -> str:
  return (f"{100 * row['passes_share']:.1f} % "
          f"({100 * row.get('passes_share_with_evaluation', math.nan):.1f} %)")


def _policy_cell(arm: Arm, row: dict, base) -> str:
  """'`top_k` entropy, 38.5 % kept in epochs 1-17, then 2 on all data (`--config....`;
  the study's `topk_anneal-45`)': what it trains on (`_kept_cell`), how to run it."""
  config = grid.apply(base, arm.overrides)
  flags = " ".join(f"--config.{k}={v}" for k, v in arm.overrides.items()
                   if k.startswith("selection."))
  kept = _kept_cell(row).replace(" in epochs", " kept in epochs", 1)
  return (f"`{config.selection.method}` {config.selection.score}, {kept} (`{flags}`; the "
          f"study's `{arm.name}`)")


def _cost(v: dict, bootstrap: bool = True) -> str:
  """'-0.13 [-0.20, -0.05] (seeds 3-12, TOST p 0.044; with the test images [-0.26, +0.01])',
  the two-level bootstrap's interval where the verdict has it and `bootstrap`."""
  seeds = v["seeds"]
  test = (f"one-sided p {v['p']:.3f}" if "superior" in v else f"TOST p {v['p']:.3f}")
  both = (v.get("test_images") or {}).get("seeds_and_images")
  images = f"; with the test images {_bracket(both)}" if both and bootstrap else ""
  return f"{_pts_interval(v)} (seeds {seeds[0]}-{seeds[-1]}, {test}{images})"


def _time_mean_cell(time: dict) -> str:
  """Tier C's wall-clock ratio (`mean_ratios`: arithmetic means) and its machine."""
  if not time.get("wall_seeds"):
    return "not measured beside full data on one kind of machine"
  even = (f"{time['even_wall_ratio']:.2f} (mean over seeds {','.join(map(str, time['even_seeds']))}"
          f", both runs whole and at an even pace; " if time["even_seeds"] else "(")
  return (f"{even}{time['wall_ratio']:.2f} over seeds {','.join(map(str, time['wall_seeds']))}"
          f" with whole wall clocks) on `{'`, `'.join(time['machines'])}`")


def _time_geomean_cell(v: dict) -> str:
  """A new-seed tier's wall-clock ratio (`seconds_ratios`: geometric means) and machines."""
  if not v:
    return "not run yet"
  seconds = v["seconds"]
  if not seconds["whole_seeds"]:
    return "no pair with whole wall clocks ran on one kind of machine"
  machines = sorted({p["machine"] for p in seconds["per_seed"].values() if p["same_machine"]})
  steady = seconds["steady_seeds"]
  even = (f"{seconds['steady_wall_geomean']:.2f} (geometric mean over seeds "
          f"{','.join(map(str, steady))}, both runs whole and at an even pace; " if steady
          else "no pair both whole and at an even pace (")
  return (f"{even}{seconds['whole_wall_geomean']:.2f} over the {len(seconds['whole_seeds'])} "
          f"pairs with whole wall clocks, each on one kind of machine) on "
          f"`{'`, `'.join(machines)}`")


def _searched(summary: dict, name: str) -> str:
  """'seeds 0-2: -0.18 [-0.63, +0.28], TOST p 0.447': a search arm against full data."""
  vs = summary[name]["vs_full"]
  return f"seeds 0-2: {_pts_interval(vs)}, TOST p {vs['p']:.3f}"


def _new_seed_cost(v: dict, label: str, seeds: tuple, done: str) -> str:
  """A declared tier's cost cell: not run yet, not decided yet (k of n seeds, the interval so
  far), or its outcome in bold and its interval."""
  if not v:
    return f"{label}: not run yet"
  if not v["complete"]:
    return (f"{label}: not decided yet, {len(v['seeds'])} of {len(seeds)} seeds run "
            f"({_pts_interval(v)} so far)")
  return f"{label}: **{done}**, {_cost(v)}"


def budget_rows(out: dict, base) -> list[list[str]]:
  """One row per declared answer of the summary `out` (a summary.json): tier C's design with
  its replication (F) and their pool, tier G's, tier H's, tier N's, and full data."""
  summary, found = out["summary"], out["verdicts"]
  arms = {a.name: a for a in search_arms(base) + a2_arms() + n_arms(base)}
  rows = []
  name = out["chosen"]
  c_row = summary[f"{name}@confirm"]
  pooled = found["pooled"]
  rows.append([
      _passes_cell(c_row), _policy_cell(arms[name], c_row, base),
      f"lossless at half the passes or fewer? Chosen on validation accuracy ("
      f"{_searched(summary, name)}), then tier C (seeds 3-7) and its replication, tier F "
      "(seeds 8-12), each declared before its runs",
      f"**{_outcome(pooled, short=True)}** on all 10 seeds: {_cost(pooled)}; tier C: "
      f"{_cost(found['untouched'])}, {_outcome(found['untouched'], short=True)}; tier F: "
      f"{_cost(found['replicate'], False)}, {_outcome(found['replicate'], short=True)}",
      _time_mean_cell(c_row["time"])])
  g = out["verdict_g"]
  g_row = summary[g["arm"]]
  rows.append([
      _passes_cell(g_row), _policy_cell(arms[out["chosen_a2"]], g_row, base),
      "lossless at half the passes or fewer? Chosen on validation accuracy among tier A' "
      f"(importance sampling, InfoBatch without its weight; {_searched(summary, out['chosen_a2'])}"
      "), then tier G (seeds 13-22), declared before its runs",
      f"**{_outcome(g, short=True)}**: {_cost(g)}", _time_geomean_cell(g)])
  h, pick = out["tier_h"]["verdict"], out["tier_h"]["declared_choice"]
  h_row = summary[h["arm"]] if h else summary[pick]
  rows.append([
      _passes_cell(h_row), _policy_cell(arms[pick], h_row, base),
      "the largest lossless saving? Chosen by a rule declared before tier H's runs among the "
      f"search arms at 50-70 % of the passes ({_searched(summary, pick)}), then tier H (seeds "
      "23-32)",
      _new_seed_cost(h, "tier H", H_SEEDS, _outcome(h, short=True) if h else ""),
      _time_geomean_cell(h)])
  n = out["tier_n"]["verdict"]
  n_row = summary[n["arm"]] if n else summary[N_DESIGN]
  noisy = found.get("noisy")
  rows.append([
      _passes_cell(n_row), _policy_cell(arms[N_DESIGN], n_row, base),
      "better than full data under 20 % label noise, a noise draw per seed? Tier N (seeds "
      "23-32), declared before its runs"
      + (f"; tier D's {_pts_interval(noisy)} (seeds 3-7) was exploratory, against a full-data "
         "reference that trained epoch 5 on the flipped labels first" if noisy else ""),
      _new_seed_cost(n, "tier N", N_SEEDS, _outcome(n, short=True) if n else "")
      + (" vs full data on the same noisy labels" if n else ""),
      _time_geomean_cell(n)])
  return rows + [["100 %", "full data", "", "", ""]]


def budget_table(out: dict, base) -> str:
  """docs/studies.md's budget table (`budget_rows`) between its markers."""
  lines = [TABLE_START, "",
           "| passes, % of full (with evaluation) | policy: what it keeps | question, declared "
           "tiers | test accuracy vs full data, points [90 % t interval] | time, share of full "
           "data's (machine) |", "|---|---|---|---|---|"]
  lines += ["| " + " | ".join(row) + " |" for row in budget_rows(out, base)]
  return "\n".join(lines + ["", TABLE_END])


def write_budget_table(summary_json: str, page: str = BUDGET_TABLE_PAGE) -> None:
  """Replaces the budget table between TABLE_START and TABLE_END in `page` with
  `budget_table` of `summary_json`; the markers must be there, once each."""
  with open(summary_json, encoding="utf-8") as f:
    table = budget_table(json.load(f), base_config())
  with open(page, encoding="utf-8") as f:
    text = f.read()
  if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
    raise SystemExit(f"--budget-table: {page} needs the budget table's markers once each, "
                     f"{TABLE_START!r} and {TABLE_END!r}")
  head, rest = text.split(TABLE_START)
  with open(page, "w", encoding="utf-8") as f:
    f.write(head + table + rest.split(TABLE_END)[1])
