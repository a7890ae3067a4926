"""Settings of decoding (torch-free: the CLI builds its options from them).

`SamplingConfig` is how prompts are decoded and measured, shared by `eval --decode` (one checkpoint,
`DecodeOptions`/`DecodeConfig`; the command's EvalConfig in cli/evaluate.py adds them to eval's teacher-forced
settings) and `compare` (several drafters side by side, `CompareConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dspark.core.settings import check_settings, setting
from dspark.data.prompts import parse_spec
from dspark.core.errors import InputError
from dspark.kinds import DSPARK_LAYOUT, LAYOUTS

Layout = Literal[LAYOUTS]  # the DFlash family's decode layouts (dspark.kinds.dflash)
DraftSample = Literal["probabilistic", "greedy"]
Rejection = Literal["block", "standard"]
NGRAM_TOKENS = 4  # prompt lookup's drafts per step, where none are given: served and in the decode loop alike


@dataclass
class PromptLookupConfig:
    """vLLM's `method: ngram` settings: the suffix n-gram lengths prompt lookup matches."""

    prompt_lookup_min: int = setting(2, "ngram: shortest n-gram matched in the prompt and output so far.", ge=1)
    prompt_lookup_max: int = setting(5, "ngram: longest n-gram matched.", ge=1)

    def __post_init__(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InputError(f"--prompt-lookup-min {self.prompt_lookup_min} is above --prompt-lookup-max "
                             f"{self.prompt_lookup_max}", "pass a min no larger than the max")


@dataclass
class VerificationConfig:
    """How many drafts a step verifies, beside fixed N: from costs measured before decoding (decode/cost.py)."""

    cost_model: bool = setting(True, "Profile the verifier's check of k tokens and each drafter's proposal on this "
                                     "machine, then also decode with the best fixed k and, for a drafter with a "
                                     "confidence head, cost-driven verification (vLLM's adaptive verification).")
    calibration_prompts: str | None = setting(
        None, "[NAME=]PATH: prompts the best fixed k is chosen on, from each drafter's acceptance there (default: the "
              "validation split of the run's prepared data); never one of the reported sets.", metavar="[NAME=]PATH")
    calibration_max_prompts: int = setting(8, "Calibration prompts decoded.", ge=1, le=10_000)
    profile_repeats: int = setting(5, "Timings per measured cost (their median counts).", ge=1, le=1000)


@dataclass
class SamplingConfig:
    max_prompts: int | None = setting(20, "Prompts per set.", ge=1)
    max_new_tokens: int = setting(64, ge=1)
    temperature: float = setting(0.0, "0: greedy.", ge=0)
    draft_sample: DraftSample = setting("probabilistic", "vLLM's draft_sample_method (temperature > 0).")
    rejection: Rejection = setting("block", "vLLM's rejection_sample_method (temperature > 0).")
    dtype: Literal["float32", "bfloat16"] = setting("float32")
    seed: int = setting(0)
    ignore_eos: bool = setting(False, "Decode the full --max-new-tokens for every prompt.", negatable=False)


def _check_prompt_names(specs: list[str]) -> None:
    names = [parse_spec(spec)[0] for spec in specs]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"two --prompts sets are named {', '.join(twice)}", "name each one: --prompts NAME=PATH")


def _check_calibration(specs: list[str], verification: VerificationConfig) -> None:
    """Prompt names told apart, and the calibration set none of the reported ones (held out means held out)."""
    _check_prompt_names(specs)
    if verification.calibration_prompts:
        path = parse_spec(verification.calibration_prompts)[1].resolve()
        if any(parse_spec(spec)[1].resolve() == path for spec in specs):
            raise InputError(f"--calibration-prompts {verification.calibration_prompts} is also a reported --prompts "
                             "set: a draft count chosen on it would be tuned on what it reports",
                             "calibrate on other prompts, such as the validation split of the run's data (the default)")


@dataclass
class DecodeOptions(SamplingConfig):
    """How `eval --decode` decodes: on which prompts, in which layout, with which confidence cut."""

    prompts: list[str] = setting(
        factory=list, metavar="[NAME=]PATH", help="With --decode (repeatable): chat JSONL, ShareGPT, HumanEval, "
        "MT-bench question.jsonl, LongBench JSONL (any gzipped) or a prepared folder (default: the run's prepared "
        "data).")
    layout: Layout = setting(DSPARK_LAYOUT, "dspark: as vLLM's DSpark speculator drafts (Model Runner V2); dflash-v1: "
                                            "as vLLM V1's `method: dflash` would serve this checkpoint.")
    num_speculative_tokens: int | None = setting(None, "dflash-v1 only.", ge=1)
    confidence_threshold: float | None = setting(
        None, "Also decode with blocks cut where the confidence head's running survival falls below this.", gt=0)
    verification: VerificationConfig = setting(factory=VerificationConfig, prefixed=False)


@dataclass
class DecodeConfig(DecodeOptions):
    checkpoint: str = field(kw_only=True)
    verifier: str | None = None

    def validate(self) -> DecodeConfig:
        check_settings(self)
        if self.confidence_threshold is not None and not 0 < self.confidence_threshold <= 1:
            raise InputError(f"--confidence-threshold {self.confidence_threshold} is not in (0, 1]",
                             "pass a survival probability such as 0.5")
        _check_calibration(self.prompts, self.verification)
        if self.num_speculative_tokens is not None and self.layout == DSPARK_LAYOUT:
            raise InputError("--num-speculative-tokens applies to --layout dflash-v1 only",
                             "drop it: the dspark layout drafts what the checkpoint was trained to draft")
        return self


@dataclass
class CompareConfig(SamplingConfig):
    """`dspark compare`: drafters of every kind, and prompt lookup, on the same prompts in one decode loop."""

    drafters: list[str] = setting(
        factory=list, help="NAME=FOLDER (repeatable): a checkpoint (RUN/latest) or a `dspark export` of any kind.",
        flags=("--drafter",))
    prompts: list[str] = setting(
        factory=list, help="[NAME=]PATH (repeatable): chat JSONL, ShareGPT, HumanEval, MT-bench question.jsonl, "
                           "LongBench JSONL (any gzipped) or a prepared folder.")
    verifier: str | None = setting(None, "The verifier folder (default: the one the first drafter names).")
    ngram: bool = setting(True, "Add prompt lookup (vLLM's `method: ngram`) as a row: the no-training baseline.")
    ngram_tokens: int = setting(NGRAM_TOKENS, "Drafts per prompt-lookup step (vLLM's num_speculative_tokens).", ge=1)
    lookup: PromptLookupConfig = setting(factory=PromptLookupConfig, prefixed=False)
    verification: VerificationConfig = setting(factory=VerificationConfig, prefixed=False)
    output: str = setting("compare", "Folder for compare.json/.md/.png.")

    def validate(self) -> CompareConfig:
        check_settings(self)
        if not self.prompts:
            raise InputError("no --prompts to compare on", "pass --prompts [NAME=]PATH (repeatable)")
        if not self.drafters and not self.ngram:
            raise InputError("nothing to compare: no --drafter and --no-ngram", "pass --drafter NAME=FOLDER")
        names = [d.split("=", 1)[0] for d in self.drafters]
        bad = [d for d in self.drafters if "=" not in d or not d.split("=", 1)[0] or not d.split("=", 1)[1]]
        if bad:
            raise InputError(f"--drafter {bad[0]!r} is not NAME=FOLDER", "e.g. --drafter dspark=runs/dspark/latest")
        if len(set(names)) < len(names) or (self.ngram and "ngram" in names):
            raise InputError(f"two drafters are named alike in {names + ['ngram'] * self.ngram}",
                             "give each --drafter its own NAME (`ngram` is prompt lookup's)")
        _check_calibration(self.prompts, self.verification)
        return self
