#include "documents/json_document.hpp"

#include "cpattn/parse.hpp"

namespace cpattn {
namespace {

// An error's value as typed: a number only where its decimal text is exactly what was typed ("010" stays
// "010", not 10), the bytes that are not UTF-8 (or are control characters) as \xNN escapes rather than
// replaced.
nlohmann::json value_json(const std::string& v) {
  if (!v.empty() && v.size() < 19 && v.find_first_not_of("-0123456789") == std::string::npos &&
      v.find('-', 1) == std::string::npos && v != "-" && std::to_string(std::stoll(v)) == v) {
    return std::stoll(v);
  }
  if (v == "true") return true;
  if (v == "false") return false;
  // quoted() shortens past 200 characters: a longer value (a path) goes whole, only its bytes that are not
  // UTF-8 escaped.
  return v.size() <= 200 ? quoted(v) : utf8_safe(v);
}

}  // namespace

nlohmann::ordered_json attention_to_json(const AttentionSpec& a) {
  nlohmann::ordered_json doc = {{"batch", a.batch},           {"seq", a.seq_len},
                                {"q_heads", a.num_q_heads},   {"kv_heads", a.num_kv_heads},
                                {"head_dim", a.head_dim},     {"causal", a.causal},
                                {"dtype", to_string(a.dtype)}};
  // The window as the keys a query sees: {"left": L, "right": R} (null: unbounded; causal: right 0), or null.
  doc["window"] = nullptr;
  if (a.windowed()) {
    const PositionBand band = a.band();
    const auto side = [](std::int64_t v) {
      return v < kUnboundedWindow ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
    };
    doc["window"] = {{"left", side(band.left)}, {"right", side(band.right)}};
  }
  doc["softcap"] = a.softcap ? nlohmann::ordered_json(*a.softcap) : nlohmann::ordered_json(nullptr);
  doc["sinks"] = a.sinks;
  return doc;
}

std::string window_text(const AttentionSpec& a) {
  std::string text;
  if (a.windowed()) {
    const PositionBand band = a.band();
    const auto side = [](std::int64_t v) { return v < kUnboundedWindow ? std::to_string(v) : "unbounded"; };
    text = ", window " + side(band.left) + " back" + (a.causal ? "" : ", " + side(band.right) + " ahead");
  }
  if (a.softcap) {
    std::ostringstream cap;
    cap << *a.softcap;
    text += ", softcap " + cap.str();
  }
  if (a.sinks) text += ", sinks";
  return text;
}

std::string errors_to_json(const std::vector<ErrorItem>& errors) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& e : errors) {
    nlohmann::json item;
    std::vector<std::string> fields;
    for (const auto& f : e.fields) fields.push_back(utf8_safe(f));
    item["field"] = fields.empty() ? "" : fields.front();
    if (fields.size() > 1) item["fields"] = fields;
    item["value"] = value_json(e.value);
    item["message"] = utf8_safe(e.message);
    list.push_back(item);
  }
  return json_text(list);
}

std::string failure_json(const std::string& key, const std::vector<ErrorItem>& errors) {
  return "{\"" + key + "\": false, \"errors\": " + errors_to_json(errors) + "}";
}

std::string json_text(const nlohmann::ordered_json& doc, int indent) {
  return doc.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string json_text(const nlohmann::json& doc, int indent) {
  return doc.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::ordered_json record_json(const CollectiveRecord& c, bool across_hosts) {
  nlohmann::ordered_json entry = {{"kind", to_string(c.kind)},
                                  {"phase", c.phase},
                                  {"count", c.count},
                                  {"bytes", c.bytes},
                                  {"bytes_sent_per_rank", c.bytes_sent_per_rank}};
  if (across_hosts) entry["bytes_sent_across_hosts"] = c.bytes_sent_across_hosts;
  if (!c.group.empty()) entry["group"] = c.group;  // the hybrid's sub-communicator
  return entry;
}

nlohmann::ordered_json records_json(const std::vector<CollectiveRecord>& records) {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (const auto& c : records) a.push_back(record_json(c));
  return a;
}

}  // namespace cpattn
