//! Money as a limit's units: a price per unit ([`UnitPrice`], integer micro-units of money per
//! so many units), a model's prices ([`ModelPrice`]: input, cached input, output) and a table
//! of them by model ([`PriceTable`], read from YAML in `yaml/prices.rs`), for a stream's meter
//! (feature `stream`).

use std::collections::BTreeMap;

/// A price in integer micro-units of money (micro-dollars, say) per `per` units (tokens): the
/// money a limit counts when a meter charges a key at it
/// ([`StreamMeterBuilder::per_unit_at`](crate::StreamMeterBuilder::per_unit_at)). A cost is
/// rounded up to a whole micro-unit; a stream is charged its running total rounded up, so
/// that its messages together cost exactly the price of all their units, never a micro-unit
/// more per message.
///
/// ```
/// use tower_ratelimits::UnitPrice;
/// // $0.15 per million tokens, in micro-dollars.
/// let price = UnitPrice::new(150_000, 1_000_000);
/// assert_eq!(price.cost(1_000_000), 150_000);
/// assert_eq!(price.cost(7), 2); // 1.05 micro-dollars, rounded up
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitPrice {
    micro: u64,
    per: u64,
}

impl UnitPrice {
    /// `micro_units` of money per `per_units` units (a `per_units` of 0 is taken as 1).
    pub fn new(micro_units: u64, per_units: u64) -> Self {
        Self {
            micro: micro_units,
            per: per_units.max(1),
        }
    }

    /// The price of `units`, in micro-units rounded up (saturating at `u64::MAX`).
    pub fn cost(&self, units: u64) -> u64 {
        let total = u128::from(units) * u128::from(self.micro);
        u64::try_from(total.div_ceil(u128::from(self.per))).unwrap_or(u64::MAX)
    }

    /// What `units` more cost a stream that was charged for `before`: the running total's
    /// price less what it was charged, so the stream's charges add up to its units' price.
    pub(crate) fn between(&self, before: u64, units: u64) -> u64 {
        self.cost(before.saturating_add(units))
            .saturating_sub(self.cost(before))
    }
}

/// A model's prices: its input (prompt) tokens, its cached input tokens and its output tokens,
/// each a [`UnitPrice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPrice {
    pub(crate) input: UnitPrice,
    pub(crate) cached_input: UnitPrice,
    pub(crate) output: UnitPrice,
}

impl ModelPrice {
    /// The price of a prompt's tokens.
    pub fn input(&self) -> UnitPrice {
        self.input
    }

    /// The price of its cached tokens (the input price where the table gives none).
    pub fn cached_input(&self) -> UnitPrice {
        self.cached_input
    }

    /// The price of an answer's tokens.
    pub fn output(&self) -> UnitPrice {
        self.output
    }

    /// What a prompt of `tokens` tokens, `cached` of them cached (at most `tokens`), costs.
    pub fn prompt_cost(&self, tokens: u64, cached: u64) -> u64 {
        let cached = cached.min(tokens);
        self.input
            .cost(tokens - cached)
            .saturating_add(self.cached_input.cost(cached))
    }
}

/// Which of a model's prices a rule charges ([`Rule::priced`](crate::Rule::priced); `of:` in
/// a rules file's `price`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PriceOf {
    /// The prompt's tokens ([`ModelPrice::input`]).
    Input,
    /// The prompt's cached tokens ([`ModelPrice::cached_input`]).
    CachedInput,
    /// The answer's tokens ([`ModelPrice::output`]).
    Output,
}

impl ModelPrice {
    /// The price `of` says.
    pub fn of(&self, of: PriceOf) -> UnitPrice {
        match of {
            PriceOf::Input => self.input,
            PriceOf::CachedInput => self.cached_input,
            PriceOf::Output => self.output,
        }
    }
}

/// Prices by model, read from YAML (feature `yaml`): integer micro-units of money per
/// `per_tokens` tokens (a million by default), for each model's `input`, `output` and, if it
/// differs from the input's, `cached_input`.
///
/// ```
/// use tower_ratelimits::PriceTable;
/// let prices = PriceTable::from_yaml_str(
///     "per_tokens: 1000000\n\
///      models:\n  \
///        small: {input: 150000, cached_input: 75000, output: 600000}\n  \
///        large: {input: 2500000, output: 10000000}\n",
/// )?;
/// let small = prices.model("small").unwrap();
/// assert_eq!(small.output().cost(2_000), 1_200); // micro-units
/// assert_eq!(small.prompt_cost(1_000_000, 500_000), 112_500);
/// assert!(prices.model("huge").is_none());
/// # Ok::<(), tower_ratelimits::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PriceTable {
    pub(crate) models: BTreeMap<String, ModelPrice>,
}

impl PriceTable {
    /// A model's prices, `None` for a model the table does not name.
    pub fn model(&self, name: &str) -> Option<ModelPrice> {
        self.models.get(name).copied()
    }

    /// The models the table names, in order.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's charges add up to the price of all its units, whatever sizes its messages
    /// have: every split of 0..=40 units into messages of 1..=7, at prices that do and do not
    /// divide evenly.
    #[test]
    fn a_streams_charges_add_up_to_its_units_price() {
        for (micro, per) in [
            (1, 1),
            (3, 7),
            (150_000, 1_000_000),
            (40, 1),
            (0, 5),
            (9, 2),
        ] {
            let price = UnitPrice::new(micro, per);
            for step in 1..=7u64 {
                let (mut before, mut charged) = (0, 0);
                while before < 40 {
                    let units = step.min(40 - before);
                    let cost = price.between(before, units);
                    // Never more than one micro-unit above the message's own share.
                    assert!(cost <= price.cost(units) + 1, "{price:?} {before} {units}");
                    charged += cost;
                    before += units;
                }
                assert_eq!(charged, price.cost(40), "{price:?} step {step}");
            }
        }
    }

    /// A cost rounds up to a whole micro-unit and saturates instead of wrapping.
    #[test]
    fn a_cost_rounds_up_and_saturates() {
        let price = UnitPrice::new(150_000, 1_000_000);
        assert_eq!((price.cost(0), price.cost(1), price.cost(7)), (0, 1, 2));
        assert_eq!(UnitPrice::new(u64::MAX, 1).cost(u64::MAX), u64::MAX);
        assert_eq!(UnitPrice::new(5, 0).cost(3), 15);
        let model = ModelPrice {
            input: UnitPrice::new(10, 1),
            cached_input: UnitPrice::new(1, 1),
            output: UnitPrice::new(40, 1),
        };
        assert_eq!(model.prompt_cost(100, 60), 40 * 10 + 60);
        assert_eq!(model.prompt_cost(10, 60), 10);
    }
}
