//! Error answers written by the middleware: JSON or `problem+json` bodies, gRPC
//! trailers-only statuses, and telling a gRPC request.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use super::*;

/// A gRPC trailers-only response: HTTP 200 with `grpc-status` and `grpc-message` in the
/// headers and an empty body.
pub fn grpc_status(code: u8, message: &str) -> Response<Bytes> {
    let mut r = Response::new(Bytes::new());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", number(u64::from(code)));
    // grpc-message is percent-encoded (gRPC over HTTP/2 spec).
    let mut encoded = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(v) = HeaderValue::try_from(encoded) {
        h.insert("grpc-message", v);
    }
    r
}

/// The JSON `code` of an error status: its reason phrase, upper case, without spaces
/// (`400` -> `BADREQUEST`, `401` -> `UNAUTHORIZED`, `500` -> `INTERNALSERVERERROR`).
pub(crate) fn error_code(status: StatusCode) -> String {
    status
        .canonical_reason()
        .unwrap_or("ERROR")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

/// An error answer written by the middleware (not a rate limit): a JSON body with `code`
/// and `message`, or for gRPC a trailers-only status (`code` maps to a gRPC code).
pub(crate) fn error_response(
    status: StatusCode,
    code: &str,
    message: &str,
    grpc: bool,
    body: ErrorBody,
) -> Response<Bytes> {
    if grpc {
        let grpc_code = match status {
            StatusCode::BAD_REQUEST => 3,          // INVALID_ARGUMENT
            StatusCode::UNAUTHORIZED => 16,        // UNAUTHENTICATED
            StatusCode::SERVICE_UNAVAILABLE => 14, // UNAVAILABLE
            _ => 13,                               // INTERNAL
        };
        return grpc_status(grpc_code, message);
    }
    body.error(status, code, message)
}

/// `application/problem+json` (RFC 9457).
pub(super) const PROBLEM_JSON: &str = "application/problem+json";

/// The problem type of a request refused because its key is banned by a limit's penalty ladder
/// (`docs/penalties.md`): the page of the rule, as a URI.
pub const BANNED: &str =
    "https://docs.rs/tower-ratelimits/latest/tower_ratelimits/specs/penalties/";

/// The problem type of a rate-limited request (draft-ietf-httpapi-ratelimit-headers-11).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Writes `value`'s text as a JSON string (quoted and escaped), with no string in between.
pub(super) fn json_text(out: &mut Vec<u8>, value: impl std::fmt::Display) {
    use serde::Serializer;
    // Writing to a Vec cannot fail, nor can the Display of a name, an id or a number.
    let _ = serde_json::Serializer::new(out).collect_str(&value);
}

/// Writes an id as a JSON string, as its `Display` text: an IPv4 address or a number with
/// integer digits ([`Id::digits`](crate::key::Id::digits)), the rest escaped.
pub(super) fn json_id(out: &mut Vec<u8>, id: &crate::key::Id) {
    match id.digits() {
        Some(digits) => {
            out.push(b'"');
            out.extend_from_slice(digits.as_bytes());
            out.push(b'"');
        }
        None => json_text(out, id),
    }
}

pub(super) fn json_response(
    status: StatusCode,
    body: Bytes,
    content_type: &'static str,
) -> Response<Bytes> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Whether a request is a gRPC call (`content-type: application/grpc...`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}
