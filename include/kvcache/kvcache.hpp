#pragma once
/// @file kvcache.hpp
/// Umbrella header: the whole public CPU API of kvcache.

#include <kvcache/attend.hpp>
#include <kvcache/block_pool.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/config.hpp>
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/two_tier_cache.hpp>
#include <kvcache/view.hpp>
