// The program text NVRTC compiled, made host C++: the only two changes, both in place and
// keeping every line where it was (so the compiler's messages point at the original lines):
// - `extern __shared__ T name[];` (dynamic shared memory) becomes a pointer to the block's
//   dynamic shared buffer;
// - `asm("<instr> %0, %1, ...;" : "=c"(out)... : "c"(in)...)` (one PTX instruction) becomes
//   `cudasim_ptx_<instr, dots as underscores>(out..., in...)`, defined in cuda_on_cpu.h.
// Then, per `extern "C" __global__` function, a CUDASIM_EXPORT_KERNEL line is appended.
#include "translate.h"

#include <ctype.h>

namespace {

bool ident(char c) { return isalnum((unsigned char)c) || c == '_'; }

size_t skip_ws(const std::string& s, size_t i) {
  while (i < s.size() && isspace((unsigned char)s[i])) ++i;
  return i;
}

bool word_at(const std::string& s, size_t i, const char* w) {
  const size_t n = strlen(w);
  if (s.compare(i, n, w) != 0) return false;
  if (i > 0 && ident(s[i - 1])) return false;
  return i + n >= s.size() || !ident(s[i + n]);
}

// The index just past the parenthesis matching s[open] (which is '('), honouring strings.
size_t match_paren(const std::string& s, size_t open) {
  int depth = 0;
  for (size_t i = open; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      for (++i; i < s.size() && s[i] != '"'; ++i)
        if (s[i] == '\\') ++i;
    } else if (c == '(') {
      ++depth;
    } else if (c == ')') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string::npos;
}

std::string newlines_of(const std::string& s) {
  std::string n;
  for (char c : s)
    if (c == '\n') n += '\n';
  return n;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && isspace((unsigned char)s[a])) ++a;
  while (b > a && isspace((unsigned char)s[b - 1])) --b;
  return s.substr(a, b - a);
}

// Splits the inside of asm(...) at top-level ':' (outside strings and parentheses).
std::vector<std::string> split_colons(const std::string& s) {
  std::vector<std::string> parts(1);
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      const size_t start = i;
      for (++i; i < s.size() && s[i] != '"'; ++i)
        if (s[i] == '\\') ++i;
      parts.back() += s.substr(start, i - start + 1);
      continue;
    }
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (c == ':' && depth == 0) {
      parts.emplace_back();
      continue;
    }
    parts.back() += c;
  }
  return parts;
}

// The expressions of `"=f"(x), "h"(y)`.
bool operands(const std::string& s, std::vector<std::string>& out) {
  size_t i = skip_ws(s, 0);
  while (i < s.size()) {
    if (s[i] != '"') return false;
    const size_t q = s.find('"', i + 1);
    if (q == std::string::npos) return false;
    const size_t open = skip_ws(s, q + 1);
    if (open >= s.size() || s[open] != '(') return false;
    const size_t close = match_paren(s, open);
    if (close == std::string::npos) return false;
    out.push_back(s.substr(open, close - open));
    i = skip_ws(s, close);
    if (i < s.size() && s[i] == ',') i = skip_ws(s, i + 1);
  }
  return true;
}

// One asm statement's inside to a call, or an #error naming it.
std::string asm_call(const std::string& inside, std::string& err) {
  std::vector<std::string> parts = split_colons(inside);
  std::string tmpl;
  for (size_t i = 0; i < parts[0].size(); ++i) {  // concatenated string literals
    if (parts[0][i] != '"') continue;
    for (++i; i < parts[0].size() && parts[0][i] != '"'; ++i) tmpl += parts[0][i];
  }
  std::vector<std::string> ops;
  const bool ok = parts.size() >= 2 && parts.size() <= 4 && operands(parts[1], ops) &&
                  (parts.size() < 3 || operands(parts[2], ops));
  // The template must be one instruction with operands %0, %1, ... in order.
  std::string t = trim(tmpl);
  if (!t.empty() && t.back() == ';') t.pop_back();
  const size_t sp = t.find_first_of(" \t");
  std::string mnem = t.substr(0, sp);
  std::string expect;
  for (size_t k = 0; k < ops.size(); ++k) expect += (k ? ", %" : "%") + std::to_string(k);
  std::string rest = sp == std::string::npos ? "" : trim(t.substr(sp));
  std::string norm;
  for (char c : rest)
    if (!isspace((unsigned char)c)) norm += c;
  std::string enorm;
  for (char c : expect)
    if (!isspace((unsigned char)c)) enorm += c;
  if (!ok || mnem.empty() || norm != enorm || t.find(';') != std::string::npos) {
    err = "unsupported inline PTX (one instruction with operands %0, %1, ... in order is "
          "simulated): " + trim(tmpl);
    return "";
  }
  std::string fn = "cudasim_ptx_";
  for (char c : mnem) fn += (c == '.') ? '_' : c;
  std::string call = fn + "(";
  for (size_t k = 0; k < ops.size(); ++k) call += (k ? ", " : "") + ops[k];
  return call + ")";
}

}  // namespace

bool cudasim_translate(const std::string& src, const std::string& name, std::string& out,
                       std::vector<std::string>& kernels, std::string& err) {
  out = "#line 1 \"" + name + "\"\n";
  size_t i = 0;
  while (i < src.size()) {
    const char c = src[i];
    // Comments and literals pass through untouched.
    if (c == '/' && i + 1 < src.size() && src[i + 1] == '/') {
      const size_t e = src.find('\n', i);
      const size_t end = e == std::string::npos ? src.size() : e;
      out.append(src, i, end - i);
      i = end;
      continue;
    }
    if (c == '/' && i + 1 < src.size() && src[i + 1] == '*') {
      const size_t e = src.find("*/", i + 2);
      const size_t end = e == std::string::npos ? src.size() : e + 2;
      out.append(src, i, end - i);
      i = end;
      continue;
    }
    if (c == '"' || c == '\'') {
      size_t j = i + 1;
      for (; j < src.size() && src[j] != c; ++j)
        if (src[j] == '\\') ++j;
      out.append(src, i, j + 1 - i);
      i = j + 1;
      continue;
    }
    if (word_at(src, i, "extern")) {
      size_t j = skip_ws(src, i + 6);
      if (src.compare(j, 3, "\"C\"") == 0) {
        // extern "C" __global__ [__launch_bounds__(...)] void NAME(
        size_t k = skip_ws(src, j + 3);
        if (word_at(src, k, "__global__")) {
          k = skip_ws(src, k + 10);
          if (word_at(src, k, "__launch_bounds__")) {
            const size_t open = src.find('(', k);
            k = skip_ws(src, match_paren(src, open));
          }
          if (word_at(src, k, "void")) {
            k = skip_ws(src, k + 4);
            size_t e = k;
            while (e < src.size() && ident(src[e])) ++e;
            if (e > k) kernels.push_back(src.substr(k, e - k));
          }
        }
      } else if (word_at(src, j, "__shared__")) {
        const size_t semi = src.find(';', j);
        if (semi == std::string::npos) {
          err = "unterminated extern __shared__ declaration";
          return false;
        }
        std::string decl = src.substr(j + 10, semi - j - 10);  // "T name[]"
        // Drop __align__(n): the buffer is 16-byte aligned anyway.
        const size_t al = decl.find("__align__");
        if (al != std::string::npos) {
          const size_t open = decl.find('(', al);
          decl.erase(al, match_paren(decl, open) - al);
        }
        const size_t br = decl.rfind('[');
        std::string head = trim(decl.substr(0, br == std::string::npos ? decl.size() : br));
        size_t ne = head.size();
        while (ne > 0 && ident(head[ne - 1])) --ne;
        const std::string var = head.substr(ne), type = trim(head.substr(0, ne));
        if (br == std::string::npos || var.empty() || type.empty()) {
          err = "cannot read the extern __shared__ declaration `" + trim(decl) + "`";
          return false;
        }
        out += type + "* const " + var + " = static_cast<" + type +
               "*>(cudasim_dynamic_shared());" + newlines_of(src.substr(i, semi - i));
        i = semi + 1;
        continue;
      }
    }
    if (word_at(src, i, "asm") || word_at(src, i, "__asm__")) {
      size_t j = skip_ws(src, i + (src[i] == 'a' ? 3 : 7));
      if (word_at(src, j, "volatile")) j = skip_ws(src, j + 8);
      if (j < src.size() && src[j] == '(') {
        const size_t close = match_paren(src, j);
        if (close == std::string::npos) {
          err = "unterminated asm statement";
          return false;
        }
        std::string e;
        const std::string call = asm_call(src.substr(j + 1, close - j - 2), e);
        if (!e.empty()) {
          err = e;
          return false;
        }
        out += call + newlines_of(src.substr(i, close - i));
        i = close;
        continue;
      }
    }
    out += c;
    ++i;
  }
  out += "\n";
  for (const std::string& k : kernels) out += "CUDASIM_EXPORT_KERNEL(" + k + ")\n";
  return true;
}

#ifdef CUDASIM_TRANSLATE_MAIN
// cudasim-translate NAME < program > host C++ (the build's tests compile through it).
#include <iostream>
#include <iterator>
int main(int argc, char** argv) {
  std::string src((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::string out, err;
  std::vector<std::string> kernels;
  if (!cudasim_translate(src, argc > 1 ? argv[1] : "program.cu", out, kernels, err)) {
    std::cerr << "cudasim-translate: " << err << "\n";
    return 1;
  }
  std::cout << out;
  return 0;
}
#endif
