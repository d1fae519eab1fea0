#include "tokenizer/unicode.h"

#include <algorithm>
#include <vector>

namespace dflash::tok {
namespace {

struct CccEntry {
  uint32_t cp;
  uint8_t ccc;
};
struct DecompEntry {
  uint32_t cp;
  uint32_t offset;
  uint32_t length;
};
struct CompEntry {
  uint32_t first;
  uint32_t second;
  uint32_t composite;
};
#include "tokenizer/nfc_data.inc"

constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr int kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr int kHangulNCount = kHangulVCount * kHangulTCount, kHangulSCount = 11172;

int ccc_of(char32_t c) {
  if (c < 0x300) return 0;  // nothing below U+0300 is a combining mark
  auto it = std::lower_bound(std::begin(kCcc), std::end(kCcc), c,
                             [](const CccEntry& e, char32_t v) { return e.cp < v; });
  return it != std::end(kCcc) && it->cp == c ? it->ccc : 0;
}

void decompose(char32_t c, std::u32string& out) {
  if (c >= kHangulS && c < kHangulS + kHangulSCount) {
    int s = static_cast<int>(c - kHangulS);
    out.push_back(kHangulL + s / kHangulNCount);
    out.push_back(kHangulV + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount) out.push_back(kHangulT + s % kHangulTCount);
    return;
  }
  if (c >= 0xC0) {
    auto it = std::lower_bound(std::begin(kDecomp), std::end(kDecomp), c,
                               [](const DecompEntry& e, char32_t v) { return e.cp < v; });
    if (it != std::end(kDecomp) && it->cp == c) {
      out.append(reinterpret_cast<const char32_t*>(kDecompData) + it->offset, it->length);
      return;
    }
  }
  out.push_back(c);
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV &&
      b < kHangulV + kHangulVCount) {
    return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  }
  if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 &&
      b > kHangulT && b < kHangulT + kHangulTCount) {
    return a + (b - kHangulT);
  }
  CompEntry key{a, b, 0};
  auto it = std::lower_bound(std::begin(kComp), std::end(kComp), key,
                             [](const CompEntry& x, const CompEntry& y) {
                               return x.first != y.first ? x.first < y.first : x.second < y.second;
                             });
  if (it != std::end(kComp) && it->first == a && it->second == b) return it->composite;
  return 0;
}

// The multi-byte sequence whose lead byte is p[i] (>= 0x80): how many of its bytes form a
// valid prefix (0 when the lead byte itself is invalid) and whether that prefix is a whole
// character. Ranges per the Unicode standard's table of well-formed UTF-8.
struct Utf8Scan {
  size_t valid;
  bool complete;
};

Utf8Scan scan_utf8(const unsigned char* p, size_t i, size_t n) {
  const unsigned char b = p[i];
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return {0, false};
  }
  int got = 0;
  for (size_t j = i + 1; got < need && j < n; ++j, ++got) {
    const unsigned char c = p[j];
    if (got == 0 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
  }
  return {static_cast<size_t>(got) + 1, got == need};
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0, n = s.size(); i < n;) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Utf8Scan scan = scan_utf8(p, i, n);
    if (!scan.complete) return i;
    i += scan.valid;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0, n = s.size(); i < n;) {
    if (p[i] < 0x80) {
      out.push_back(static_cast<char>(p[i++]));
      continue;
    }
    // A broken sequence's longest valid prefix (at least its lead byte) becomes one U+FFFD.
    const Utf8Scan scan = scan_utf8(p, i, n);
    if (scan.complete) {
      out.append(s.data() + i, scan.valid);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += std::max<size_t>(scan.valid, 1);
  }
  return out;
}

char32_t next_code_point(std::string_view s, size_t& i) {
  auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) {
    ++i;
    return b;
  }
  int extra = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
  char32_t c = b & (0x3F >> extra);
  for (int k = 1; k <= extra; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += extra + 1;
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

bool is_nfc_quick(std::string_view s) {
  // Below U+0300 nothing decomposes or combines except Latin-1 letters, which are already
  // precomposed; ASCII-only text is the common fast path.
  for (char ch : s) {
    if (static_cast<unsigned char>(ch) >= 0x80) return false;
  }
  return true;
}

std::string nfc(std::string_view s) {
  if (is_nfc_quick(s)) return std::string(s);
  // Canonical decomposition, canonical ordering, then canonical composition (UAX #15).
  std::u32string d;
  d.reserve(s.size());
  for (size_t i = 0; i < s.size();) decompose(next_code_point(s, i), d);
  std::vector<uint8_t> cls(d.size());
  for (size_t i = 0; i < d.size(); ++i) cls[i] = static_cast<uint8_t>(ccc_of(d[i]));
  for (size_t i = 0; i < d.size();) {  // stable sort each run of non-starters by class
    if (cls[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && cls[j] != 0) ++j;
    for (size_t a = i + 1; a < j; ++a) {
      for (size_t b = a; b > i && cls[b - 1] > cls[b]; --b) {
        std::swap(d[b - 1], d[b]);
        std::swap(cls[b - 1], cls[b]);
      }
    }
    i = j;
  }
  std::string out;
  out.reserve(s.size());
  if (d.empty()) return out;
  // Text that opens with non-starters has nothing to compose them with until a starter comes.
  bool have_starter = cls[0] == 0;
  size_t starter = 0, w = 1;
  int last_class = cls[0];
  for (size_t r = 1; r < d.size(); ++r) {
    char32_t c = d[r];
    int k = cls[r];
    char32_t composite = have_starter ? compose_pair(d[starter], c) : 0;
    if (composite && (last_class < k || last_class == 0)) {
      d[starter] = composite;
      continue;
    }
    if (k == 0) {
      starter = w;
      have_starter = true;
    }
    last_class = k;
    d[w++] = c;
  }
  d.resize(w);
  for (char32_t c : d) append_utf8(out, c);
  return out;
}

bool is_python_space(char32_t c) {
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

}  // namespace dflash::tok
