"""Paper Table 4: ResNet-34 (1.32x) and ResNet-50 (2.31x, 2.56x, 3.06x) on ImageNet.

Runs its rows over --seeds with dtp_kernels/configs/paper/; what it needs: python/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline.experiments import table_script

if __name__ == "__main__":
    sys.exit(table_script(["table4-resnet34", "table4-resnet50"]))
