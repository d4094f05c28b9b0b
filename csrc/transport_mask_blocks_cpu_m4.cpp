// The tiny-segment CPU kernels' tile loops for segments of 4 (transport_blocks_cpu.h).
#include "transport_blocks_cpu_tiles.h"

DTP_INSTANTIATE_BLOCKS_CPU(4)
