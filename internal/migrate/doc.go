// Package migrate continues a generation whose upstream died mid-answer on
// another worker, so the client reads one uninterrupted response.
//
// It is independent of transport. A Tracker is fed every SSE event the
// client received (Splitter cuts a byte stream into events) and keeps what
// a continuation needs: the text and, when the response carries them, the
// token ids generated so far, the number of tokens delivered, whether the
// chat role delta was sent, and the original's id, created and model.
// Request parses the client's body once, says whether the request can be
// continued at all (Refusal), and builds the continuation body (Continue):
// completions send the prompt followed by the answer so far (token ids when
// both are known, else text), chat sends the conversation with the partial
// answer as an open final assistant message (vLLM's continue_final_message
// with add_generation_prompt=false); max_tokens / max_completion_tokens and
// min_tokens shrink by the tokens already delivered. A Stitcher rewrites the
// continuation leg's events into the original's: id, created and model of
// the original, no second role delta, no second prompt_token_ids, usage
// counted over the whole answer (prompt = the original prompt's), and a stop
// string straddling the cut still ends the answer.
//
// docs/RELIABILITY.md ("Mid-stream migration") lists what is exact, best
// effort and refused.
package migrate
