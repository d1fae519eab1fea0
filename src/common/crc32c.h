// common: CRC-32C, the checksum of prepared-data shards (cheap enough to verify every shard at
// load) and of TensorBoard event records (the format prescribes it). Hardware-accelerated where
// the CPU has SSE4.2.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dflash {

// CRC-32C (Castagnoli), the iSCSI/ext4 polynomial; `crc` continues a previous value.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace dflash
