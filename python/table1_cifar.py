"""Paper Table 1: ResNet-56 on CIFAR-10 and VGG-19 on CIFAR-100, five ratios each.

Runs its rows over --seeds with dtp_kernels/configs/paper/; what it needs: python/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline.experiments import table_script

if __name__ == "__main__":
    sys.exit(table_script(["table1-resnet56", "table1-vgg19"]))
