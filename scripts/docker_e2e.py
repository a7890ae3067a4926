"""The compose pipeline end to end on the CPU defaults, inspected through the docker SDK.

Run by scripts/docker-e2e.sh once both images exist (scripts/docker-build.sh):
  0. both images carry `cc` and their Python's Python.h: Triton builds its launcher with them at run
     time (torch.compile and the fused losses in training, vLLM's Model Runner V2 on CUDA);
  1. live: `docker compose up -d`; once training has checkpointed, the trainer container is
     killed (SIGKILL) while the master and the extractor stay healthy;
  2. `docker compose --profile live --profile offline up -d`: the live trainer must resume from
     that checkpoint, finish, and stop the master and the extractor, while the offline profile runs
     beside it (extract --to zarr, train --from zarr); then each leaves checkpoints, an eval report,
     an export, and a cache or store that `dspark store verify` accepts;
  3. `docker compose up` once more (attached) exits by itself and redoes nothing.
Three `compose up` calls in all. The toy settings are the CPU deployment's (configs/cpu.yaml) with
what no check depends on made smaller: one epoch of training instead of two, and a toy verifier
pre-trained for TOY_STEPS steps instead of 150 (an env file of its own: .env.example plus these).
It prints the wall time of each part and the image sizes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROJECT = os.environ.get("E2E_PROJECT", "dspark-e2e")
TAG = os.environ.get("DSPARK_TAG", "latest")
NAME = "demo"
TOY_STEPS = os.environ.get("E2E_TOY_STEPS", "20")  # the toy verifier's pre-training steps (the deployment's: 150)
# One thread a process: several share the 2 cores here, and two OpenMP threads each then wait on each other.
THREADS = os.environ.get("E2E_OMP_NUM_THREADS", "1")
EPOCHS = int(os.environ.get("E2E_EPOCHS", "1"))  # configs/cpu.yaml trains 2: one still checkpoints 4 times
PROFILES = ("--profile", "live", "--profile", "offline")
client = docker.from_env()


def say(msg: str) -> None:
    print(f"[docker-e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compose(env: dict, *args: str, timeout: float = 1800) -> None:
    subprocess.run(["docker", "compose", "-p", PROJECT, *args], cwd=ROOT, env=env, check=True, timeout=timeout)


def containers(service: str | None = None) -> list:
    labels = [f"com.docker.compose.project={PROJECT}"]
    if service:
        labels.append(f"com.docker.compose.service={service}")
    return client.containers.list(all=True, filters={"label": labels})


def container(service: str):
    found = containers(service)
    assert len(found) == 1, f"{service}: expected one container, found {len(found)}"
    return found[0]


def state(c) -> dict:
    c.reload()
    return c.attrs["State"]


def wait_until(predicate, timeout: float, what: str, interval: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            dump_logs()
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def sigkill(c, timeout: float = 300) -> None:
    """SIGKILL c and wait until it has exited. dockerd waits 10 s for the exit event and then
    answers the kill with 500 "did not receive an exit event", although the signal was sent: a
    loaded machine can take longer to reap a process that is writing a checkpoint. So say it,
    send it again while the container still runs, and wait for the exit."""
    def exited() -> bool:
        if state(c)["Status"] == "exited":
            return True
        try:
            c.kill()
        except docker.errors.APIError as e:  # also "is not running" when it exits meanwhile
            say(f"kill {c.name}: {e.explanation}; waiting for it to exit")
        return False
    wait_until(exited, timeout, f"{c.name} to exit after SIGKILL", interval=5)


def dump_logs() -> None:
    for c in containers():
        print(f"--- {c.name} ({state(c)['Status']}, exit {state(c)['ExitCode']})", file=sys.stderr)
        print(c.logs(tail=30).decode(errors="replace"), file=sys.stderr)


def exited_ok(*services: str) -> None:
    for s in services:
        st = state(container(s))
        if st["Status"] != "exited" or st["ExitCode"] != 0:
            dump_logs()
            raise AssertionError(f"{s}: {st['Status']}, exit code {st['ExitCode']} (expected exited, 0)")


# Each says what is missing, in the words of the fix.
TOOLCHAIN = """command -v cc >/dev/null || { echo 'no C compiler (cc): install gcc and libc6-dev' >&2; exit 1; }
python -c 'import os, sys, sysconfig; h = os.path.join(sysconfig.get_paths()["include"], "Python.h")
sys.exit(0 if os.path.exists(h) else f"no {h}: install the headers of this Python (python3-dev)")'"""


def check_toolchain() -> None:
    for image in (f"dspark-trainer:{TAG}", f"dspark-extractor:{TAG}"):
        try:
            client.containers.run(image, ["-c", TOOLCHAIN], entrypoint="sh", remove=True, stderr=True)
        except docker.errors.ContainerError as e:
            why = (e.stderr or b"").decode(errors="replace").strip()
            raise AssertionError(f"{image} cannot build Triton's launcher: {why}. docker/bin/dspark-image-setup "
                                 "installs them: rebuild with scripts/docker-build.sh") from None
    say("both images carry cc and Python.h")


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step-[0-9]*") if not p.name.endswith(".tmp"))


def dspark(cache: Path, *args: str) -> str:
    """`dspark ARGS` in a throwaway trainer container, with the cache mounted."""
    out = client.containers.run(f"dspark-trainer:{TAG}", list(args), remove=True,
                                volumes={str(cache): {"bind": "/cache", "mode": "rw"}})
    return out.decode()


def check_outputs(cache: Path, source: str, store: str) -> dict:
    """A finished run: its checkpoints, eval report and export, and a store that verifies."""
    run = cache / "runs" / f"{NAME}-{source}"
    ckpts = checkpoints(run)
    assert ckpts, f"no checkpoint in {run}"
    latest = (run / "latest").resolve()
    assert latest.name == ckpts[-1], f"latest -> {latest.name}, newest checkpoint {ckpts[-1]}"
    report = json.loads((latest / "eval" / "eval.json").read_text())
    assert len(report["positions"]) == 8 and report["blocks"] > 0, f"eval report: {report}"
    assert 1.0 <= report["tau_greedy"] <= 9.0, f"tau {report['tau_greedy']} (1 + accepted of 8 drafts)"
    assert (latest / "eval" / "eval.png").stat().st_size > 0
    export = cache / "export" / f"{NAME}-{source}"
    cfg = json.loads((export / "config.json").read_text())
    assert (export / "model.safetensors").stat().st_size > 0
    verify = dspark(cache, "store", "verify", f"/cache/{store}")
    say(f"{source}: {len(ckpts)} checkpoints, latest {latest.name}; eval tau {report['tau_greedy']:.3f} "
        f"over {report['blocks']} blocks; "
        f"export {cfg.get('architectures')}; store verify: {verify.strip().splitlines()[-1]}")
    return {"run": run, "latest": latest, "export": export}


def settings(cache: Path) -> dict:
    """The CPU deployment, smaller where no check depends on size: configs/cpu.yaml with EPOCHS epochs
    as /cache/e2e.yaml, and .env.example naming it, with TOY_STEPS and THREADS, as the containers' env file."""
    config = yaml.safe_load((ROOT / "configs" / "cpu.yaml").read_text())
    config["train"]["epochs"] = EPOCHS
    (cache / "e2e.yaml").write_text(yaml.safe_dump(config))
    ours = {"DSPARK_CONFIG": "/cache/e2e.yaml", "TOY_STEPS": TOY_STEPS, "OMP_NUM_THREADS": THREADS}
    lines = [l for l in (ROOT / ".env.example").read_text().splitlines() if l.split("=")[0] not in ours]
    (cache / "e2e.env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in ours.items()), ""]))
    return {"DSPARK_ENV_FILE": str(cache / "e2e.env")}


def main() -> None:
    check_toolchain()
    cache = Path(tempfile.mkdtemp(prefix="dspark-e2e-"))
    env = {**os.environ, "DSPARK_CACHE": str(cache), "DSPARK_TAG": TAG, **settings(cache)}
    os.chown(cache, 1000, 1000)  # the containers' user (DSPARK_UID)
    times = {}
    try:
        # 1. live, with the trainer killed once it has checkpointed
        t = time.monotonic()
        compose(env, "up", "-d")
        say(f"stack up (extractor healthy) in {time.monotonic() - t:.0f}s")
        run = cache / "runs" / f"{NAME}-mooncake"
        trainer = container("trainer")
        wait_until(lambda: checkpoints(run) or state(trainer)["Status"] == "exited", 900, "a first checkpoint")
        assert state(trainer)["Status"] == "running", "the trainer ended before it could be killed"
        sigkill(trainer)
        killed_at = (run / "latest").resolve().name
        say(f"trainer killed (SIGKILL) after {killed_at}")
        for s in ("mooncake-master", "extractor"):
            st = state(container(s))
            assert st["Status"] == "running" and st["Health"]["Status"] == "healthy", f"{s}: {st}"
        times["live until the kill"] = time.monotonic() - t

        # 2. up -d again, with the offline profile beside it: the trainer resumes, the offline pipeline runs
        t = time.monotonic()
        compose(env, *PROFILES, "up", "-d")
        steps = [container(s) for s in ("mooncake-master", "extractor", "trainer", "extract", "train-offline")]
        wait_until(lambda: all(state(c)["Status"] == "exited" for c in steps), 1800, "both pipelines to finish")
        exited_ok("prepare", "mooncake-master", "extractor", "trainer", "extract", "train-offline")
        logs = container("trainer").logs().decode(errors="replace")
        assert f"from {killed_at}" in logs, f"the trainer did not resume from {killed_at}:\n{logs[-2000:]}"
        live = check_outputs(cache, "mooncake", f"live-cache/{NAME}")
        assert checkpoints(live["run"])[-1] > killed_at
        check_outputs(cache, "zarr", f"stores/{NAME}")
        times["live resumed + offline"] = time.monotonic() - t

        # 3. up again: exits by itself, redoes nothing
        t = time.monotonic()
        before = {p: p.stat().st_mtime for p in (live["latest"] / "eval" / "eval.json", live["export"] / "config.json")}
        compose(env, "up", timeout=1200)
        exited_ok("prepare", "mooncake-master", "extractor", "trainer")
        assert checkpoints(live["run"])[-1] == live["latest"].name, "training ran again"
        assert all(p.stat().st_mtime == m for p, m in before.items()), "eval or export ran again"
        times["live, up again (nothing to do)"] = time.monotonic() - t
    finally:
        compose(env, *PROFILES, "down", "--remove-orphans", timeout=300)
        # The containers wrote as uid 1000; a root CI can remove it, a user keeps it to look at.
        if os.environ.get("E2E_KEEP") != "1":
            shutil.rmtree(cache, ignore_errors=True)
    for what, secs in times.items():
        say(f"{what}: {secs:.0f}s")
    for image in ("trainer", "extractor"):
        size = client.images.get(f"dspark-{image}:{TAG}").attrs["Size"]
        say(f"dspark-{image}:{TAG}: {size / 2**30:.2f} GiB")
    say("ok")


if __name__ == "__main__":
    main()
