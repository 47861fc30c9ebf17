// The program-text translation of tools/sim/translate.cc.
#pragma once
#include <string.h>

#include <string>
#include <vector>

// Translates `src` (named `name` in messages) to host C++ in `out`, listing the
// `extern "C" __global__` entry points in `kernels`; false with `err` when it cannot.
bool cudasim_translate(const std::string& src, const std::string& name, std::string& out,
                       std::vector<std::string>& kernels, std::string& err);
