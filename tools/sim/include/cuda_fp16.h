// cuda_fp16.h for the simulator: everything lives in cuda_on_cpu.h (force-included).
#pragma once
#include "cuda_on_cpu.h"
