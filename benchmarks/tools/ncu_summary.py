"""Print the lines of an ncu report the device scripts quote: from the ``--page details`` CSV the speed-of-light,
issue, scheduler and memory figures of each kernel (plus metric names containing any ``--also`` string), from the
``--page raw`` CSV each kernel's eight largest warp-stall reasons per issued instruction.

    python3 benchmarks/tools/ncu_summary.py details.csv raw.csv [--also Pipe]
"""
import argparse
import csv

KEEP = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Issue Slots Busy", "Issued Warp Per Scheduler",
        "No Eligible", "Stall", "Warp Cycles Per Issued Instruction", "L2 Hit Rate", "DRAM Throughput", "Executed Ipc")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("details")
    ap.add_argument("raw")
    ap.add_argument("--also", nargs="*", default=[], help="more metric-name substrings to print")
    args = ap.parse_args()
    keep = KEEP + tuple(args.also)
    for r in csv.DictReader(open(args.details)):
        if any(k in r.get("Metric Name", "") for k in keep):
            print(r.get("ID"), r.get("Section Name", "")[:22], r["Metric Name"][:48], r.get("Metric Value"),
                  r.get("Metric Unit"))
    raw = list(csv.reader(open(args.raw)))
    head = raw[0]
    for row in raw[2:]:
        vals = ((v.replace(",", ""), h) for h, v in zip(head, row) if "issue_stalled" in h)
        stalls = sorted(((float(v), h) for v, h in vals if v.replace(".", "", 1).isdigit()), reverse=True)
        print("kernel", row[head.index("ID")] if "ID" in head else "?",
              [(h.split("stalled_")[1].split("_per")[0], v) for v, h in stalls[:8]])


if __name__ == "__main__":
    main()
