// data: checksums for prepared datasets. CRC-32C (hardware-accelerated where the CPU has
// SSE4.2) guards shard files, cheap enough to verify every shard at load; SHA-256 identifies
// the tokenizer a dataset was made with.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::data {

// CRC-32C (Castagnoli), the iSCSI/ext4 polynomial; `crc` continues a previous value.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// Lower-case hex SHA-256 of `bytes`.
std::string sha256_hex(std::string_view bytes);

}  // namespace dflash::data
