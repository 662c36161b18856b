// Point-to-point byte messages between the ranks of a group that cpattn does not run (a torch.distributed
// process group): what a backend outside the library gives, so that cpattn's collectives, and with them every
// strategy, run over it (make_communicator(Backend::transport, options with `transport` set)).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cpattn {

class Transport {
 public:
  struct Message {
    int peer = 0;          // the peer's rank in the transport's group
    void* data = nullptr;  // a send's bytes are read, a receive's written
    std::size_t bytes = 0;
  };
  // Messages in flight. wait() completes them within `timeout`, or throws Error(communication) naming what
  // failed or which peer made no progress. Destroyed without a completed wait (its rank is failing), it must
  // leave the buffers untouched afterwards: the transport waits for its messages, or ends the process.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait(std::chrono::milliseconds timeout) = 0;
  };

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // for messages: "torch.distributed (gloo)"
  // Starts the sends and receives of one step: messages between two ranks with one tag are matched in the
  // order they were started; a receive expects exactly the bytes its peer sends (the communicator agrees on
  // sizes beforehand where they could differ). Tags are below 2^31.
  virtual std::unique_ptr<Pending> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                         std::int64_t tag) = 0;
};

}  // namespace cpattn
