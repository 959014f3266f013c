"""The mutation score of the last `make mutation` run (mutmut's results in mutants/), by file.

    python -m benchmarks.mutation_score [--survivors]

Killed and timed-out mutants count as caught (a mutant that loops for ever is caught by its
timeout); mutants no fast test reaches count as not caught, like survivors. Mutants listed in
EQUIVALENT (docs/testing.md says why each one cannot change behaviour) are left out of the score.
Writes benchmarks/results/mutation.<machine>.<date>.json (the score does not depend on the machine;
the name follows the other results').
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from benchmarks.common import RESULTS, console, print_table, result_path

MUTANTS = Path(__file__).resolve().parents[1] / "mutants"
CAUGHT = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout"}
# Mutants that cannot change what a caller observes, by the shape of their one-line change
# (docs/testing.md, "Equivalent mutants"): (name, why, the change with that argument taken out of both
# sides must leave the line as it was).
ARGUMENT = r"(?:{name}=[^,()]*(?:\([^()]*\))?)"
EQUIVALENT_KINDS = (
    ("device", "on the CPU, where the fast tests run, device=None and no device are the CPU; the CUDA "
               "path is what tests/model/test_cuda.py (gpu marker) checks", ARGUMENT.format(name="device")),
    ("zip-strict", "the zipped sequences have equal lengths by construction: strict only guards against a "
                   "bug elsewhere", ARGUMENT.format(name="strict")),
    ("int64", "torch.tensor of Python ints is int64 whatever dtype says or omits", ARGUMENT.format(name="dtype")),
    ("last-dim", "dim=-1 is the default of topk (the only call where dropping it survives)",
     ARGUMENT.format(name="dim")),
)
# "message-text" (`_message_text_only`): a message reworded by case or XX-wrapping; the tests check
# what a refusal or error says (the request, the sizes, the limit), not its letters.
# Which removed argument each kind requires (an int64 dtype, not any dtype).
REQUIRED = {"int64": r"dtype=torch\.(?:long|int64)\b", "device": r"device=", "zip-strict": r"strict=True",
            "last-dim": r"\.topk\(.*dim=-1"}
# Changes equivalent in the one place they occur: (kind, why, the original, the mutant), as regexes.
EQUIVALENT_LINES = (
    ("falsy-flag", "the flag is only tested for truth, where None and False are alike",
     r"(?:self\._started|self\._closed) = False|cache_full=False|popitem\(last=False\)|writable=False",
     r"(?:self\._started|self\._closed) = None|cache_full=None|popitem\(last=None\)|writable=None"),
    ("dim-one", "the sampler's tensors are 2-D (rows, vocabulary): dim=+1 is dim=-1",
     r"dim=-1", r"dim=\+1"),
    ("cpu-device", "on the CPU, where the fast tests run, a device of None is the CPU (the gpu tests check CUDA)",
     r"device = (?:logits|raw_logits)\.device|\.to\(device\)|, vocab_size, device\)",
     r"device = None|\.to\(None\)|, vocab_size, None\)"),
    ("unsigned-ids", "prompt token ids are checked to lie in [0, vocabulary) before anything hashes them "
                     "(serving.service.check_prompt), where signed and unsigned 64-bit give the same bytes",
     r'array\("q", token_ids\)', r'array\("Q", token_ids\)'),
    ("always-cast", "casting a view that already is flat bytes to bytes gives the same view of the same memory",
     r'view\.cast\("B"\) if view\.format != "B" or view\.ndim != 1 else view',
     r'view\.cast\("B"\) if (?:\(view\.format != "B" or view\.ndim != 1\) or True|'
     r'view\.format != "XXBXX" or view\.ndim != 1) else view'),
    ("unreadable-header", "the injected corruption must make the header unreadable: any bytes that are no msgpack "
                          "map are refused as MALFORMED alike",
     r'header_bytes = b""|bytes\(byte \^ 0x5A for byte in header_bytes\)',
     r'header_bytes = b"XXXX"|bytes\(byte (?:&|\^|\|) (?:0x5[AB]|9[01]) for byte in header_bytes\)'),
    ("msgpack-defaults", "msgpack's defaults are raw=False and strict_map_key=True; a non-str key fails as a "
                         "keyword argument anyway (malformed header)",
     r"msgpack\.unpackb\(data, raw=False, strict_map_key=True\)",
     r"msgpack\.unpackb\(data, (?:raw=(?:False|None), ?)?(?:strict_map_key=(?:True|None|False))?,? ?\)"),
    ("stop-search-window", "an earlier match would have stopped the stream at an earlier token: searching the "
                           "whole text finds the same first match, only slower",
     r"self\.text\.find\(s, search_from\)|search_from = max\(0, previous_length - self\._stop_hold\)",
     r"self\.text\.find\(s, (?:None)?,? ?\)|search_from = None"),
)
# Equivalent mutants read one by one (the reasoning is in docs/testing.md), by name: a name belongs
# to one version of its function, so a change to the function means reading its survivors again.
SAMPLER = "cluster.model.sampler.x_"
EQUIVALENT_NAMED = {
    **{f"{SAMPLER}_top_p_cutoffs__mutmut_{n}": "top-p-inactive-rows" for n in (63, 64, 65, 68)},
    **{f"{SAMPLER}top_k_top_p_cutoffs__mutmut_{n}": "cost-only" for n in (24, 28, 29, 35, 37, 38, 45)},
    f"{SAMPLER}_top_p_cutoffs__mutmut_103": "cost-only",  # a redundant re-rank at exact equality
    f"{SAMPLER}_top_p_cutoffs__mutmut_20": "cost-only",  # torch.where picks norm when every row has top-k
    f"{SAMPLER}_top_p_cutoffs__mutmut_42": "top-k-dominates",
    f"{SAMPLER}_top_p_cutoffs__mutmut_53": "top-p-of-one", f"{SAMPLER}_top_p_cutoffs__mutmut_54": "top-p-of-one",
    f"{SAMPLER}token_occurrences__mutmut_16": "same-call",  # repeat_interleave(lengths) as documented
    f"{SAMPLER}apply_penalties__mutmut_27": "zero-logit",  # 0 divided or multiplied by the penalty is 0
    "cluster.engine.scheduler.xǁSchedulerǁfail_remote__mutmut_12": "waiting-status",
    # The in-process connector is the tests' own (LocalService runs no transfers); they pass deadlines.
    "cluster.transfer.loopback.xǁLoopbackSenderǁ__init____mutmut_1": "test-connector-default",
    "cluster.engine.scheduler.xǁSchedulerǁ_schedule_running__mutmut_6": "cost-only",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁ__init____mutmut_8": "none-slice",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁ_decode_new_text__mutmut_8": "none-slice",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁfinish__mutmut_12": "none-slice",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁ_emit_until__mutmut_1": "empty-emit",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁfinish__mutmut_1": "nothing-pending",
    "cluster.weights.detokenizer.xǁIncrementalDetokenizerǁfinish__mutmut_3": "nothing-pending",
    # Survivors of the complete run, read one by one; reasons in docs/testing.md.
    "cluster.engine.block_pool.xǁBlockPoolǁfree__mutmut_11": "unreachable",  # no hash without prefix caching
    "cluster.engine.kv_cache_manager.xǁKVCacheManagerǁ_cache_full_blocks__mutmut_10": "cost-only",
    **{f"cluster.engine.kv_cache_manager.xǁKVCacheManagerǁallocate_slots__mutmut_{n}": "cost-only"
       for n in (7, 10, 11, 51, 53)},  # the slow path, or allocating 0 blocks, gives the same blocks
    "cluster.engine.kv_cache_manager.xǁKVCacheManagerǁfree__mutmut_14": "unreachable",  # a running request has a table
    "cluster.engine.scheduler.xǁSchedulerǁ_push_waiting__mutmut_9": "unreachable",  # FCFS: one constant for all
    **{f"cluster.engine.scheduler.xǁSchedulerǁ_schedule_running__mutmut_{n}": "unreachable"
       for n in (15, 17, 18, 19, 20)},  # a running request always has a token to compute
    **{f"cluster.engine.scheduler.xǁSchedulerǁfinish__mutmut_{n}": "unreachable" for n in (16, 19)},
    f"{SAMPLER}apply_min_p__mutmut_3": "cost-only",  # a threshold of 0 removes nothing
    **{f"{SAMPLER}apply_top_k_top_p__mutmut_{n}": "cost-only" for n in (15, 16, 17, 18, 20, 21)},
    f"{SAMPLER}process_logits__mutmut_17": "cost-only",  # neutral penalties leave every value as it was
    **{f"cluster.model.sampler.xǁSamplerǁ__call____mutmut_{n}": "cost-only" for n in (11, 14)},  # same plan again
    **{f"cluster.model.sampler.xǁSamplerǁ_draw_exponentials__mutmut_{n}": "cpu-device" for n in (10, 30)},
    "cluster.model.sampler.xǁSamplerǁ_sample_random__mutmut_27": "cpu-device",
    **{f"cluster.transfer.loopback.xǁReceiveTableǁadmit__mutmut_{n}": "message-text" for n in (14, 15)},
    "cluster.transfer.connector.xǁKVReceiverǁexpect__mutmut_1": "abstract",  # a Protocol's default, never run
}
EQUIVALENT: dict[str, str] = {}  # mutant name -> kind, filled by `classify`


def changed_lines(name: str) -> tuple[list[str], list[str]]:
    """The removed and the added lines of a mutant's diff."""
    from mutmut.__main__ import find_mutant
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(name, path=find_mutant(name).path).split("\n")
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def equivalent_kind(removed: list[str], added: list[str]) -> str | None:
    """The kind of equivalent change this is, if it is one of EQUIVALENT_KINDS."""
    if len(removed) != 1 or len(added) != 1:
        return None
    if removed[0].replace('float("-inf")', 'float("-INF")') == added[0] or \
            removed[0].replace('float("inf")', 'float("INF")') == added[0]:
        return "minus-inf"  # float() reads the case-insensitive spelling alike
    if _message_text_only(removed[0], added[0]):
        return "message-text"
    for kind, _, original, mutant in EQUIVALENT_LINES:
        if re.search(original, removed[0]) and re.search(mutant, added[0]) and \
                re.sub(original, "@", removed[0]) == re.sub(mutant, "@", added[0]):
            return kind
    for kind, _, pattern in EQUIVALENT_KINDS:
        strip = re.compile(rf",?\s*{pattern}\s*,?")
        if re.search(REQUIRED[kind], removed[0]) and \
                _squash(strip.sub("", removed[0])) == _squash(strip.sub("", added[0])):
            return kind
    return None


def _message_text_only(removed: str, added: str) -> bool:
    """Whether a message's wording is all that changed: the same line but for the text of its string
    literals, XX-wrapped or in another case, on a line that raises or names a reason or message."""
    if not re.search(r"raise |Error\(|Refused\(|reason|message", removed) or removed == added:
        return False
    literal = re.compile(r'(["\'])(.*?)\1')
    if literal.sub("@", removed) != literal.sub("@", added):
        return False

    def texts(line: str) -> list[str]:
        return [match.group(2).lower().replace("xx", "") for match in literal.finditer(line)]

    return texts(removed) == texts(added)


def _squash(line: str) -> str:
    return re.sub(r"[\s,]", "", line)


def classify(statuses: dict[str, str]) -> None:
    """Fill EQUIVALENT with the survivors whose change is of an equivalent kind."""
    for name, state in statuses.items():
        if state == "survived":
            kind = EQUIVALENT_NAMED.get(name) or equivalent_kind(*changed_lines(name))
            if kind is not None:
                EQUIVALENT[name] = kind


def status(exit_code: int | None) -> str:
    if exit_code is None:
        return "not checked"
    if exit_code in CAUGHT:
        return CAUGHT[exit_code]
    return {0: "survived", 5: "no tests", 33: "no tests"}.get(exit_code, "suspicious")


def results() -> dict[str, str]:
    """Mutant name -> status, over every mutated file."""
    found: dict[str, str] = {}
    for meta in sorted(MUTANTS.rglob("*.meta")):
        for name, exit_code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = status(exit_code)
    return found


def score(statuses: dict[str, str]) -> dict[str, dict[str, int | float]]:
    """Per module and in all: caught, not caught, equivalent, the score in percent."""
    by_module: dict[str, Counter[str]] = {}
    for name, state in statuses.items():
        module = name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]
        counts = by_module.setdefault(module, Counter())
        counts["equivalent" if name in EQUIVALENT else state] += 1
    table: dict[str, dict[str, int | float]] = {}
    total: Counter[str] = Counter()
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        table[module] = _row(counts)
    table["all"] = _row(total)
    return table


def _row(counts: Counter[str]) -> dict[str, int | float]:
    caught = counts["killed"] + counts["timeout"]
    missed = counts["survived"] + counts["no tests"] + counts["suspicious"]
    scored = caught + missed
    return {"caught": caught, "survived": counts["survived"], "no_tests": counts["no tests"],
            "equivalent": counts["equivalent"], "not_checked": counts["not checked"],
            "score": round(100 * caught / scored, 1) if scored else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--survivors", action="store_true", help="list every mutant not caught")
    args = parser.parse_args()
    statuses = results()
    if not statuses:
        console.print("no mutmut results in mutants/: run `make mutation` first")
        return 2
    classify(statuses)
    table = score(statuses)
    print_table("mutation score (caught = killed + timeout; equivalent mutants left out)",
                ["module", "caught", "survived", "no tests", "equivalent", "not checked", "score %"],
                [[module, row["caught"], row["survived"], row["no_tests"], row["equivalent"], row["not_checked"],
                  row["score"]] for module, row in table.items()])
    missed = sorted(name for name, state in statuses.items()
                    if state in ("survived", "no tests", "suspicious") and name not in EQUIVALENT)
    if args.survivors:
        for name in missed:
            console.print(f"{statuses[name]}: {name}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path("mutation")
    path.write_text(json.dumps({"score": table, "not_caught": {name: statuses[name] for name in missed},
                                "equivalent": EQUIVALENT}, indent=1) + "\n")
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
