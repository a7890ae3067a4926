"""Start vLLM as the hidden-state extractor (the seed's extraction command line); see dspark/extract/launch.py.

    python scripts/launch_vllm.py MODEL --hidden-states-backend mooncake --mooncake-master HOST:PORT \
        --target-layer-ids 24 48 72 88 92 -- <vllm serve flags>
"""

from dspark.deployment import SECTIONS
from dspark.extract.launch import main

if __name__ == "__main__":
    main(sections=SECTIONS)
