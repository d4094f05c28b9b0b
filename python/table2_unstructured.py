"""Paper Table 2: unstructured ResNet-50 on ImageNet at 82.7% of the weights.

Runs every row over --seeds (default 0 1 2) with the appendix's recipes in
configs/paper/ and writes results.md (mean ± std after and before fine-tuning, the
paper's figure beside it) under --out. Until the data set and the dense weights are
where the recipes say (or --set points at them), it prints what it needs and the
commands. Each run takes the paper's full schedule: GPU work (see the README).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline.experiments import table_script

if __name__ == "__main__":
    sys.exit(table_script(["table2-resnet50-unstructured"]))
