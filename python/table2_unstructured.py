"""Paper Table 2: unstructured ResNet-50 on ImageNet at 82.7% of the weights.

Runs its rows over --seeds with dtp_kernels/configs/paper/; what it needs: python/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtp_kernels.pipeline.experiments import table_script

if __name__ == "__main__":
    sys.exit(table_script(["table2-resnet50-unstructured"]))
