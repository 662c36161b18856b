// The JSON pieces every answer of cpattn shares (validate, plan, run, bench): the problem block, errors, a
// failed command's one document, collective records, and the text of a document, always valid UTF-8.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "cpattn/collectives.hpp"
#include "cpattn/config.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

// The attention problem as the "problem" block of every command's JSON: batch, seq, q_heads, kv_heads,
// head_dim, causal, dtype, window ({"left", "right"}: null where unbounded; null when none), softcap (null
// when none), sinks (true or false); commands append their own keys.
nlohmann::ordered_json attention_to_json(const AttentionSpec& attention);
// The window, soft-cap and sinks for a line of text: ", window 1023 back" (causal), ", window 64 back, 64
// ahead", ", softcap 50", ", sinks", any of them together, or "" (none).
std::string window_text(const AttentionSpec& attention);

// JSON for a list of errors: [{"field", "fields"?, "value", "message"}].
std::string errors_to_json(const std::vector<ErrorItem>& errors);
// A failed command's one JSON document: {"<key>": false, "errors": [...]} (key "ok" for run and bench,
// "valid" for validate and plan).
std::string failure_json(const std::string& key, const std::vector<ErrorItem>& errors);

// One collective record: {kind, phase, count, bytes, bytes_sent_per_rank, bytes_sent_across_hosts (with
// `across_hosts`), group (a sub-communicator's; absent for the whole group)}.
nlohmann::ordered_json record_json(const CollectiveRecord& record, bool across_hosts = false);
nlohmann::ordered_json records_json(const std::vector<CollectiveRecord>& records);

// A document as text, always valid UTF-8 (a byte that is not is replaced by U+FFFD), never throwing on it.
std::string json_text(const nlohmann::ordered_json& doc, int indent = -1);
std::string json_text(const nlohmann::json& doc, int indent = -1);

}  // namespace cpattn
