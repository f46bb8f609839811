//! The meter a handler builds from the keys a layer's per-message rules found
//! ([`StreamKeys`], `layer/stream_keys.rs`).

use crate::layer::{KeyPrice, ModelFrom, Per, StreamKeys};

use super::StreamError;
use super::meter::StreamMeterBuilder;

/// The longest request body read for its model (1 MiB; the handler bounds what it reads).
const MAX_BODY_BYTES: usize = 1 << 20;

impl StreamKeys {
    /// A meter builder holding these keys and the rules' [`at_limit`](Self::at_limit): add
    /// keys of the handler's own (a per-stream key), grants ahead, and build. A key whose
    /// rule reads its model from the body and was not priced yet
    /// ([`price_from_body`](Self::price_from_body)) makes the build fail
    /// ([`StreamError::Unpriced`]): its units would be counted as money.
    pub fn meter(&self) -> StreamMeterBuilder {
        let mut builder = super::StreamMeter::builder(&self.limiter);
        for (key, per, price) in &self.keys {
            builder = match (per, price) {
                (Per::Unit, KeyPrice::At(price)) => builder.per_unit_at(key.clone(), *price),
                (Per::Unit, KeyPrice::FromBody(_)) => builder.unpriced(key.name()),
                (Per::Unit, KeyPrice::Unpriced) => builder.per_unit(key.clone()),
                _ => builder.per_message(key.clone()),
            };
        }
        match self.at_limit {
            Some(at_limit) => builder.at_limit(at_limit),
            None => builder,
        }
    }

    /// Prices the keys whose rule reads the model from the request's JSON body (a rules file's
    /// `price: {model: 'body:<field>'}`, [`ModelFrom::BodyField`]), from `body`: the handler
    /// reads the body (a layer decides before it is read) and hands it here before
    /// [`meter`](Self::meter). A body that is not a JSON object with the field as a string,
    /// larger than 1 MiB, or naming a model the table does not price: [`StreamError::Unpriced`]
    /// with why (answer the request with a 400). Keys priced already are left as they are.
    ///
    /// ```
    /// use tower_ratelimits::StreamKeys;
    /// # fn keys(k: &StreamKeys) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut keys: StreamKeys = k.clone(); // from the request's extensions
    /// keys.price_from_body(br#"{"model": "small", "prompt": "..."}"#)?;
    /// let meter = keys.meter().build()?;
    /// # Ok(()) }
    /// ```
    pub fn price_from_body(&mut self, body: &[u8]) -> Result<(), StreamError> {
        let mut parsed: Option<serde_json::Map<String, serde_json::Value>> = None;
        for (key, _, price) in &mut self.keys {
            let KeyPrice::FromBody(priced) = price else {
                continue;
            };
            let ModelFrom::BodyField(field) = &priced.model else {
                continue;
            };
            let unpriced = |why: String| StreamError::Unpriced(key.name(), why);
            if parsed.is_none() {
                if body.len() > MAX_BODY_BYTES {
                    return Err(unpriced("the body is larger than 1 MiB".into()));
                }
                let map = serde_json::from_slice(body)
                    .map_err(|e| unpriced(format!("the body is not a JSON object: {e}")))?;
                parsed = Some(map);
            }
            let model = parsed
                .as_ref()
                .and_then(|m| m.get(field.as_str()))
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| unpriced(format!("the body has no string field {field:?}")))?;
            *price = KeyPrice::At(priced.of_model(model).map_err(unpriced)?);
        }
        Ok(())
    }
}
