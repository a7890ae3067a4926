"""DFlash (speculators' DFlashDraftModel): a block-diffusion drafter, and the family DSpark (dspark.py) extends.

A block anchored at the last verified token fills `block_size` slots in one forward, every slot seeing the whole
context and the whole block. The family's settings, its training arguments, its decode layouts (the decode loop's
drafter is dspark.decode.drafter.Drafter) and what vLLM's `method: dflash` does with it are here.
"""

from __future__ import annotations

from dspark.core.errors import InputError
from dspark.kinds.base import Kind, register

# decode's --layout values for the family: as vLLM's DSpark speculator drafts (Model Runner V2; the checkpoint's
# own block), or as vLLM V1's `method: dflash` would serve the checkpoint (1+N slots, no Markov or confidence head)
DSPARK_LAYOUT, DFLASH_V1_LAYOUT = "dspark", "dflash-v1"
LAYOUTS = (DSPARK_LAYOUT, DFLASH_V1_LAYOUT)
# the settings only block drafters read
BLOCK_SETTINGS = frozenset({"block_size", "sample_from_anchor", "max_anchors", "dflash_decay_gamma", "mask_token_id",
                            "per_position_loss_weight", "dpace_alpha"})
RETRAIN = "train with --no-sample-from-anchor for method dflash"


@register
class DFlash(Kind):
    name, title = "dflash", "DFlash"
    model = "speculators.models.dflash:DFlashDraftModel"
    config = "speculators.models.dflash:DFlashSpeculatorConfig"
    summary = "a DFlash block-diffusion drafter"
    vllm_method = "dflash"
    decode_drafter = "dspark.decode.drafter:Drafter"
    decoder_layer = "qwen3"
    reads = BLOCK_SETTINGS
    # vLLM maps a DFlash checkpoint's sample_from_anchor into its dflash_config, which V2's DFlash speculator
    # rejects at startup; a DSpark checkpoint's flag stays top-level, where V2 does not look
    anchor_in_dflash_config = True

    def training_args(self, cfg, mask_token) -> dict:
        return dict(block_size=cfg.block_size,
                    sample_from_anchor=cfg.sample_from_anchor,  # False: DFlash's layout, what `method: dflash` serves
                    mask_token_id=mask_token(), **self.heads(cfg))

    def heads(self, cfg) -> dict:
        """Its head settings, of speculators' from_training_args."""
        # speculators trains full-attention draft layers bidirectionally whatever this says, but vLLM 0.32 reads a
        # DFlash config's `causal = not sliding_window_non_causal` for every layer: served causal, every block
        # but its first slot would see less than in training (measured: fewer drafts accepted than our loop)
        return {"sliding_window_non_causal": True}

    def decoded_as(self, config, layout) -> str:
        return self.auto_method(config) if layout == DSPARK_LAYOUT else DFlash.vllm_method  # V1's DFlash proposer

    def refuse_serving(self, method, runner, anchor, gpu, drafter) -> None:
        if method != DFlash.vllm_method or not anchor:
            return
        rejected = runner == "v2" and self.anchor_in_dflash_config
        what = ("rejects it at startup (sample_from_anchor=True is not supported for DFlash)" if rejected else
                "drafts it in DFlash's 1+N slots: every draft is shifted by one and acceptance collapses")
        raise InputError(f"{drafter} was trained with sample_from_anchor: true, and vLLM's Model Runner "
                         f"{runner.upper()} with method dflash {what}", self.anchor_fix())

    def anchor_fix(self) -> str:
        """How to serve a checkpoint trained with sample_from_anchor that `method: dflash` cannot."""
        return RETRAIN

    def serving_notes(self, config) -> list[str]:
        if config.get("sample_from_anchor"):
            return ["WARNING: this checkpoint was trained with `sample_from_anchor: true`, which vLLM's DFlash "
                    "proposers do not serve: Model Runner V2 (vLLM 0.33's default on a GPU) refuses it at startup, "
                    "and V1 shifts every draft by one. Train with `--no-sample-from-anchor` to serve it."]
        return super().serving_notes(config)
