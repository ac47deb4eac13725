"""Compare ``mxmoe train`` runs over recipes and seeds (issue 23: the ``gpu`` preset, one recipe and seed
per run): a markdown table of final validation loss per recipe (mean and spread over seeds, gap to bf16,
validation minus train) and a loss plot with a validation-difference panel and bf16's seed spread.

    python benchmarks/tools/compare_train_runs.py benchmarks/results/h200/train_gpu_*_seed*.json \
        --png benchmarks/results/h200/train_gpu_compare.png --json benchmarks/results/h200/train_gpu_compare.json
"""

import argparse
import json
from pathlib import Path

from mxmoe.train import compare_runs, compare_table, plot_compare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="metrics JSON files written by mxmoe train")
    p.add_argument("--png", help="write the loss plot here")
    p.add_argument("--json", help="write the comparison (mxmoe.train.compare_runs) here")
    args = p.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.runs]
    cmp = compare_runs(runs)
    print(compare_table(cmp))
    if args.png:
        plot_compare(runs, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": args.runs, "recipes": cmp}, indent=1))


if __name__ == "__main__":
    main()
