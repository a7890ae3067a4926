"""vLLM engines shared by the tests that use them, one per distinct engine configuration (a pytest plugin).

vLLM runs in .venv-vllm, another interpreter, so an engine cannot live in pytest's process: a shared
engine is one child process that serves every case its tests ask of it with one engine start, run once
by a module- or session-scoped fixture; each test then asserts on its own part of the result. A test
that changes a shared output copies it first. Tests whose claim is the process itself (a kill -9 and a
resume, an abort mid-prefill, a server) keep their own processes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from services import ROOT, VLLM_PY

ACCEPT = ROOT / "scripts" / "vllm_dflash_accept.py"


def in_process_env() -> dict:
    """The environment for a `vllm.LLM` script: its engine core and worker in the script's own process, as
    `dspark extract --engine vllm` runs them (vLLM's default spawns both: three vLLM imports per start, not
    one; on 2 shared cores ~110 s of startup instead of ~40)."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def accept_jobs(verifier: Path, drafter: Path, folder: Path, jobs: dict[str, tuple[list[list[int]], int]],
                *args) -> dict[str, dict]:
    """One `scripts/vllm_dflash_accept.py --jobs` run: one vLLM engine serving `drafter`, every named job
    (its prompts, its --max-new-tokens) generated on it in turn; each job's output JSON, by name (what a run
    of the script with only that job's prompts writes). `args`: the script's engine flags."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = [{"prompts": prompts, "max_new_tokens": new, "output": str(folder / f"{name}.json")}
            for name, (prompts, new) in jobs.items()]
    (folder / "jobs.json").write_text(json.dumps(spec))
    proc = subprocess.run([str(VLLM_PY), str(ACCEPT), "--verifier", str(verifier), "--drafter", str(drafter),
                           "--jobs", str(folder / "jobs.json"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env=in_process_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in jobs}
