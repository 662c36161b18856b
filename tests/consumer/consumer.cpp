#include <cpattn/placement.hpp>

#include <iostream>

int main() {
  cpattn::AttentionSpec a;
  a.seq_len = 65536;
  a.num_q_heads = 32;
  a.num_kv_heads = 2;
  a.head_dim = 256;
  cpattn::ParallelSpec p;
  p.cp = 4;
  p.strategy = cpattn::Strategy::ulysses;
  const auto ranks = cpattn::head_placement(a, p);
  std::cout << "rank 1 kv head " << ranks[1].kv_heads[0] << "\n";
  return ranks[1].kv_heads[0] == 0 && ranks[2].kv_heads[0] == 1 ? 0 : 1;
}
