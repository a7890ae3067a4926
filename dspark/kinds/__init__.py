"""Drafter kinds: what each `dspark train --speculator-type` is in training, in our decode loop, in eval and in vLLM.

    base.py    Kind, the seam (its lifecycle per stage in its docstring), KINDS (dspark.core.registry's Registry),
               kind_of (the kind a checkpoint's config.json names; one line for one dspark does not know)
    dflash.py  DFlash: the block family, its settings and decode layouts
    dspark.py  DSpark: DFlash with the Markov and confidence heads, vLLM's `method: dspark`
    eagle3.py  EAGLE-3: autoregressive over 3 fused layers, no block

Every stage calls its kind and compares no kind name (tests/test_kind_seam.py). Speculators' classes and the
decode loop's drafters come through "module:Class" strings loaded at use: train, decode, eval, export and serving
all import it.

Imports: core, vllm_server (its runner constant).
"""

from dspark.kinds.base import DEFAULT_KIND, KINDS, Kind, kind_of, register, serving_kind, vllm_methods
from dspark.kinds.dflash import DFLASH_V1_LAYOUT, DSPARK_LAYOUT, LAYOUTS

__all__ = ["DEFAULT_KIND", "DFLASH_V1_LAYOUT", "DSPARK_LAYOUT", "KINDS", "LAYOUTS", "Kind", "kind_of", "register",
           "serving_kind", "vllm_methods"]
