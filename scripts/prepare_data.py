"""The seed's `prepare_data.py` command line, run by `dspark prepare`:

    python scripts/prepare_data.py --model MODEL --data chat.jsonl --output prepared/ --seq-length 4096 ...
"""

import sys

from dspark.cli import main

if __name__ == "__main__":
    main(["prepare", *sys.argv[1:]], prog_name="prepare_data.py")
