"""EAGLE-3 (speculators' Eagle3DraftModel): an autoregressive drafter over 3 fused verifier layers, trained with
training-time test, served by vLLM's `method: eagle3` on either model runner.

No block: teacher-forced eval and the state gain, which score blocks, do not apply, and the block settings are
not read. The decode loop's drafter is dspark.decode.eagle3.Eagle3Drafter.
"""

from __future__ import annotations

from dspark.core.errors import InputError
from dspark.core.registry import load
from dspark.kinds.base import Kind, register


@register
class Eagle3(Kind):
    name, title = "eagle3", "EAGLE-3"
    model = "speculators.models.eagle3:Eagle3DraftModel"
    config = "speculators.models.eagle3:Eagle3SpeculatorConfig"
    summary = "an EAGLE-3 autoregressive drafter over 3 fused verifier layers"
    vllm_method = "eagle3"
    decode_drafter = "dspark.decode.eagle3:Eagle3Drafter"
    decoder_layer = "llama"
    blocks = False
    reads = frozenset({"ttt_steps", "ttt_step_loss_decay"})
    default_loss = "kl_div"  # speculators' EAGLE-3 default
    tokens_note = " (its training-time test steps; vLLM may draft more)"

    def check(self, cfg) -> None:
        if len(cfg.target_layer_ids) != 3:
            raise InputError(f"--speculator-type eagle3 reads 3 target layers, not {len(cfg.target_layer_ids)} "
                             f"({cfg.target_layer_ids})", "pass 3 of the store's layers, e.g. --target-layer-ids "
                             "2 N/2 N-3 for N verifier layers (vLLM's EAGLE-3 takes exactly 3)")

    def training_args(self, cfg, mask_token) -> dict:
        # speculators' EAGLE-3 CLI defaults: norms before fc and residual, the normed output fed on
        return dict(ttt_steps=cfg.ttt_steps, norm_before_residual=True, norm_before_fc=True, norm_output=True)

    def model_inputs(self, batch: dict) -> dict:
        """EAGLE-3 pairs each token with the verifier's state one position before it: speculators'
        `eagle3.data.shift_batch`, applied per document of the packed batch (row j: token x_{i+1},
        state g_i, target and loss mask of i+1; a document's last state has no successor and goes)."""
        doc = batch["document_ids"][0]
        keep = doc[:-1] == doc[1:]
        before, after = (lambda x: x[:, :-1][:, keep]), (lambda x: x[:, 1:][:, keep])  # noqa: E731
        return {"hidden_states": before(batch["hidden_states"]), "document_ids": before(batch["document_ids"]),
                **{k: after(batch[k]) for k in ("verifier_last_hidden_states", "input_ids", "loss_mask",
                                                "position_ids")}}

    def drafter(self, model, layout: str, num_speculative_tokens: int | None = None):
        return load(self.decode_drafter)(model, num_speculative_tokens)  # one layout, vLLM's EAGLE-3 proposer's
