"""Paper Table 3: MobileNetV2 on CIFAR-10/100 with a global budget at 60% and 80%.

Runs its rows over --seeds with dtp_kernels/configs/paper/; what it needs: python/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline.experiments import table_script

if __name__ == "__main__":
    sys.exit(table_script(["table3-mobilenetv2"]))
