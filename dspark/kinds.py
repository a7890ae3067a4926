"""Drafter kinds: what each `dspark train --speculator-type` is in speculators, in our decode loop and in vLLM.

A checkpoint names its kind in config.json (`speculators_model_type`, speculators' own key): every
reader (eval, export, serve-draft) dispatches on that, never on a flag repeated by the user.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from dspark.errors import InputError


@dataclass(frozen=True)
class Kind:
    name: str          # --speculator-type, and config.json's speculators_model_type
    title: str         # as people write it
    model: str         # speculators' model class, "module:Class"
    config: str        # and its config class
    summary: str       # for tables and model cards
    vllm_method: str   # the speculative config's `method` that serves its trained layout
    blocks: bool = True  # drafts a block per forward, which teacher-forced eval and the state gain score

    def _load(self, path: str):
        module, name = path.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def model_class(self):
        return self._load(self.model)

    @property
    def config_class(self):
        return self._load(self.config)


KINDS = {k.name: k for k in (
    Kind("dspark", "DSpark", "speculators.models.dspark:DSparkDraftModel", "speculators.models.dspark:DSparkSpeculatorConfig",
         "a DFlash block-diffusion drafter with a low-rank Markov logit-bias head and a confidence head", "dspark"),
    Kind("dflash", "DFlash", "speculators.models.dflash:DFlashDraftModel", "speculators.models.dflash:DFlashSpeculatorConfig",
         "a DFlash block-diffusion drafter", "dflash"),
    Kind("eagle3", "EAGLE-3", "speculators.models.eagle3:Eagle3DraftModel",
         "speculators.models.eagle3:Eagle3SpeculatorConfig",
         "an EAGLE-3 autoregressive drafter over 3 fused verifier layers", "eagle3", blocks=False),
)}


def kind_of(config: dict, where: str) -> Kind:
    """The kind a checkpoint's config.json names; one line for a drafter dspark does not know."""
    name = config.get("speculators_model_type")
    if name not in KINDS:
        raise InputError(f"{where} holds a {name!r} drafter", f"dspark reads the kinds {sorted(KINDS)}")
    return KINDS[name]
