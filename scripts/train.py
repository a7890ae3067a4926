"""The seed's `train.py` command line, run by `dspark train` (also under torchrun):

    torchrun --nproc_per_node 8 scripts/train.py --verifier-name-or-path MODEL --data-path prepared/ \
        --save-path run/ --hidden-states-backend mooncake --mooncake-master HOST:50051 \
        --vllm-endpoint http://HOST:8000/v1 --target-layer-ids 24 48 72 88 92 ...
"""

import sys

from dspark.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]], prog_name="train.py")
