//! What an engine says it served: `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens` read from the tail of a response (a JSON body, or
//! the final usage chunk of an SSE stream), without buffering the response.

use serde::Deserialize;

/// Bytes of a response's end kept to find its usage: an SSE usage chunk and the `[DONE]` after
/// it, or the end of a JSON body, fit with room to spare.
pub const TAIL_BYTES: usize = 4096;

/// Prompt tokens and those the engine served from its prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

#[derive(Deserialize)]
struct Raw {
    prompt_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The last bytes of a response, fed chunk by chunk: only a chunk's own end is ever copied in.
#[derive(Debug, Default)]
pub struct Tail {
    bytes: Vec<u8>,
}

impl Tail {
    /// How many bytes at the end of a chunk of `len` bytes are worth reading.
    pub fn wanted(len: usize) -> usize {
        len.min(TAIL_BYTES)
    }

    /// Appends the end of the next chunk, keeping at most [`TAIL_BYTES`].
    pub fn push(&mut self, end: &[u8]) {
        let end = &end[end.len().saturating_sub(TAIL_BYTES)..];
        let keep = TAIL_BYTES - end.len();
        if self.bytes.len() > keep {
            self.bytes.drain(..self.bytes.len() - keep);
        }
        self.bytes.extend_from_slice(end);
    }

    pub fn usage(&self) -> Option<Usage> {
        parse(&self.bytes)
    }
}

/// The last non-null `"usage"` object in `tail` (a JSON body's end or an SSE stream's last
/// events). `None` when there is none, or it is cut off or malformed.
pub fn parse(tail: &[u8]) -> Option<Usage> {
    const NEEDLE: &[u8] = b"\"usage\"";
    let mut end = tail.len();
    while let Some(at) = memchr::memmem::rfind(&tail[..end], NEEDLE) {
        end = at;
        let rest = &tail[at + NEEDLE.len()..];
        let rest = trim_start(rest);
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut de = serde_json::Deserializer::from_slice(rest);
        match <Option<Raw> as serde::Deserialize>::deserialize(&mut de) {
            Ok(Some(raw)) => {
                let cached = raw
                    .prompt_tokens_details
                    .and_then(|d| d.cached_tokens)
                    .unwrap_or(0);
                return Some(Usage {
                    prompt_tokens: raw.prompt_tokens,
                    cached_tokens: cached.min(raw.prompt_tokens),
                });
            }
            // `"usage": null` in an earlier chunk, or a key of that name inside other content.
            _ => continue,
        }
    }
    None
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

/// An endpoint's address as a stat name segment: `127.0.0.1:8001` → `127_0_0_1_8001`.
pub fn stat_segment(addr: &str) -> String {
    let clean: String = addr
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    clean.trim_matches('_').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SSE: &str = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
        data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1700,\"completion_tokens\":24,\
        \"total_tokens\":1724,\"prompt_tokens_details\":{\"cached_tokens\":1536}}}\n\n\
        data: [DONE]\n\n";

    #[test]
    fn the_final_sse_usage_chunk_is_read() {
        assert_eq!(
            parse(SSE.as_bytes()),
            Some(Usage {
                prompt_tokens: 1700,
                cached_tokens: 1536
            })
        );
    }

    #[test]
    fn a_json_body_gives_its_usage_and_missing_details_mean_none_cached() {
        let body = br#"{"choices":[{"message":{"content":"the \"usage\" word"}}],"usage":{"prompt_tokens":10,"completion_tokens":2}}"#;
        assert_eq!(
            parse(body),
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: 0
            })
        );
    }

    #[test]
    fn no_usage_or_a_cut_usage_is_none() {
        assert_eq!(parse(b"data: {\"usage\":null}\n\ndata: [DONE]\n\n"), None);
        assert_eq!(parse(b"{\"usage\":{\"prompt_tok"), None);
        assert_eq!(parse(b""), None);
        assert_eq!(parse(b"content mentions \"usage\" in passing"), None);
    }

    #[test]
    fn the_tail_keeps_only_the_end_across_chunks() {
        let mut tail = Tail::default();
        let filler = vec![b'x'; 10_000];
        tail.push(&filler);
        let (a, b) = SSE.as_bytes().split_at(100);
        tail.push(a);
        tail.push(b);
        assert!(tail.bytes.len() <= TAIL_BYTES);
        assert_eq!(tail.usage().map(|u| u.cached_tokens), Some(1536));
        assert_eq!(Tail::wanted(10), 10);
        assert_eq!(Tail::wanted(1 << 20), TAIL_BYTES);
    }

    #[test]
    fn stat_segments_are_plain() {
        assert_eq!(stat_segment("127.0.0.1:8001"), "127_0_0_1_8001");
        assert_eq!(stat_segment("[::1]:80"), "1__80");
    }
}
